"""Issue #5's quality bars, on the real model: SmolLM2-135M-Instruct teacher-forced over the first
2048 tokens of benchmarks/data/quant_quality_text.txt (benchmarks/quant_quality.py, the engine's
own path), each quantized configuration against the bfloat16 model:

  top-1 agreement >= 97%, perplexity within 2%.

The bars are the issue's and are not loosened. Where the current implementation misses one, the
check is marked xfail(strict=True) with the measured figure: it still runs and is reported, and
it turns into a failure (XPASS) the day the configuration meets the bar, so the mark gets removed.

"lm_head bf16" is quantize_params(..., keep=("lm_head",)) (the benchmark quantizes and hands the
engine the params): the usual practice of leaving the output projection in 16 bits. Round-to-nearest
with it (int8: 95.55% -> 96.48% here) does not reach the 97% bar either.

The "GPTQ" configurations keep the same int8 format and scales but choose the int8 values with
GPTQ (pallas_kernels/gptq.py), calibrated on benchmarks/data/calibration_text.txt, not on the
evaluated text. With the lm_head in bf16 it meets the bar here (97.21%), by 0.21 points: about 4 of
the 2046 positions. Other calibration settings moved the agreement by about +-0.5 points
(docs/BENCHMARKS.md), so this pass is narrow. GPTQ with the lm_head int8 as well misses (96.73%).

"w8a8, SmoothQuant, lm_head bf16" is what `jlight convert --quantization w8a8 --calibration` makes
(pallas_kernels/smoothquant.py, calibrated on the same calibration text): it brings w8a8's perplexity
within the bar (+1.21%, round-to-nearest +3.65%) but its agreement stays short (93.89%).
"""
import importlib.util
import os
import sys

import pytest

from conftest import REPO_ROOT

NUM_TOKENS, SEGMENT_LEN = 2048, 1024
AGREEMENT_MIN, PERPLEXITY_MAX_CHANGE = 0.97, 0.02

# Measured on the CPU machine (JAX 0.10.2) with these 2048 tokens; see docs/BENCHMARKS.md.
MISSES = {
    ("int8 weights (W8A16)", "agreement"): "measured 95.55% top-1 agreement < 97% (perplexity +0.25% passes)",
    ("w8a8", "agreement"): "measured 88.03% top-1 agreement < 97%",
    ("w8a8", "perplexity"): "measured perplexity +3.65% > 2%",
    ("int8 weights + int8 KV cache", "agreement"): "measured 95.45% top-1 agreement < 97% (int8 KV alone: 97.56%)",
    ("int8 weights, GPTQ", "agreement"): "measured 96.73% top-1 agreement < 97% (perplexity +0.34% passes)",
    ("w8a8, SmoothQuant, lm_head bf16", "agreement"): "measured 93.89% top-1 agreement < 97% (perplexity +1.21% passes)",
}
# (The round-to-nearest "lm_head bf16" variants, int8 96.48% and w8a8 88.95% agreement, both misses,
# are measured by benchmarks/quant_quality.py and kept out of the suite for its running time.)
CONFIG_NAMES = ["int8 weights (W8A16)", "w8a8", "int8 KV cache", "int8 weights + int8 KV cache", "int8 weights, GPTQ",
                "int8 weights, GPTQ, lm_head bf16", "w8a8, SmoothQuant, lm_head bf16"]


def _quant_quality():
    spec = importlib.util.spec_from_file_location("quant_quality", os.path.join(REPO_ROOT, "benchmarks", "quant_quality.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["quant_quality"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(smollm2_gguf):
    qq = _quant_quality()
    from jlight.loading import load_model

    tokenizer = load_model(smollm2_gguf, dtype="float32").tokenizer
    segments = qq.segments_of(qq.text_token_ids(tokenizer), SEGMENT_LEN, NUM_TOKENS)
    assert sum(map(len, segments)) == NUM_TOKENS
    configs = [c for c in qq.CONFIGS if c[0] == "bfloat16" or c[0] in CONFIG_NAMES]
    assert configs[0][0] == "bfloat16" and len(configs) == 1 + len(CONFIG_NAMES)
    result = {r["name"]: r for r in qq.compare(qq.measure(segments, configs, model=smollm2_gguf, log=lambda s: None))}
    print("\n" + qq.markdown(list(result.values())))
    return result


def _cases():
    for name in CONFIG_NAMES:
        for metric in ("agreement", "perplexity"):
            reason = MISSES.get((name, metric))
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
            yield pytest.param(name, metric, marks=marks, id=f"{name}-{metric}")


@pytest.mark.parametrize("name,metric", list(_cases()))
def test_quality_against_bfloat16(rows, name, metric):
    row = rows[name]
    assert row["positions"] == NUM_TOKENS - 2  # every position of the two segments but their first
    if metric == "agreement":
        assert row["top1_agreement"] >= AGREEMENT_MIN, f"{name}: top-1 agreement {row['top1_agreement']:.4f}"
    else:
        assert abs(row["perplexity_change"]) <= PERPLEXITY_MAX_CHANGE, f"{name}: perplexity {row['perplexity_change']:+.4f}"


def test_quantized_configurations_differ_from_bfloat16(rows):
    """The comparison is not vacuous: every configuration really changes some predictions."""
    for name in CONFIG_NAMES:
        assert rows[name]["top1_agreement"] < 1.0 and rows[name]["perplexity_change"] != 0.0, name
