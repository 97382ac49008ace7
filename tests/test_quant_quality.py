"""Issue #5's quality bars, on the real model: SmolLM2-135M-Instruct teacher-forced over the first
2048 tokens of benchmarks/data/quant_quality_text.txt (benchmarks/quant_quality.py, the engine's
own path), each quantized configuration against the bfloat16 model:

  top-1 agreement >= 97%, perplexity within 2%.

The bars are the issue's and are not loosened. Where the current implementation misses one, the
check is marked xfail(strict=True) with the measured figure: it still runs and is reported, and
it turns into a failure (XPASS) the day the configuration meets the bar, so the mark gets removed.
The figures below are this CPU machine's (JAX 0.10.2, 2026-12-01, the blocked reference attention).
A near-tie flips with the order of a sum, so figures move by a few tenths between hosts and between
versions of the reference attention: round-to-nearest int8 gave 95.55% with the per-token one.

"lm_head bf16" is quantize_params(..., keep=("lm_head",)) (the benchmark quantizes and hands the
engine the params): the usual practice of leaving the output projection in 16 bits. Round-to-nearest
with it (int8: 96.48% here with the per-token reference) does not reach the 97% bar either.

The "GPTQ" configurations keep the same int8 format and scales but choose the int8 values with
GPTQ (jlight/quantization/gptq.py), calibrated on benchmarks/data/calibration_text.txt, not on the
evaluated text. With the lm_head in bf16 it meets the bar here (97.26%; 97.21% on another host), by
about 5 of the 2046 positions. Other calibration settings moved the agreement by about +-0.5 points
(docs/BENCHMARKS.md), so this pass is narrow. GPTQ with the lm_head int8 as well sits on the bar:
96.73% and 96.77% with the per-token reference on two hosts, 97.12% with the blocked one. Neither a
pass nor a strict xfail would hold across hosts, so its bar check is a non-strict xfail, and a floor
of 96.5% (round-to-nearest: 95.4%) is what it must keep.

"w8a8, SmoothQuant, lm_head bf16" is what `jlight convert --quantization w8a8 --calibration` makes
(jlight/quantization/smoothquant.py, calibrated on the same calibration text): it brings w8a8's perplexity
within the bar (+0.87%, round-to-nearest +3.31%) but its agreement stays short (93.60%).
"""
import importlib.util
import os
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.research  # a measurement: `python -m pytest -m research tests` (README)

NUM_TOKENS, SEGMENT_LEN = 2048, 1024
AGREEMENT_MIN, PERPLEXITY_MAX_CHANGE = 0.97, 0.02

# Measured on the CPU machine (JAX 0.10.2) with these 2048 tokens; see docs/BENCHMARKS.md.
MISSES = {
    ("int8 weights (W8A16)", "agreement"): "measured 95.36% top-1 agreement < 97% (perplexity +0.11% passes)",
    ("w8a8, SmoothQuant, lm_head bf16", "agreement"): "measured 93.60% top-1 agreement < 97% (perplexity +0.87% passes)",
}
# At the bar's edge (module docstring): reported as xfail or xpass, never failing; GPTQ_FLOOR guards it.
EDGE = {("int8 weights, GPTQ", "agreement"): "measured 96.73-97.12% top-1 agreement across hosts and reference versions"}
GPTQ_FLOOR = 0.965
# Kept out of the suite for its running time, and measured by benchmarks/quant_quality.py: the
# round-to-nearest "lm_head bf16" variants (int8 96.48%, w8a8 88.95% agreement), round-to-nearest w8a8
# (87.83% / +3.31%; SmoothQuant is the w8a8 that `jlight convert` makes) and int8 weights with the int8
# KV cache (95.26%), all misses of the agreement bar.
CONFIG_NAMES = ["int8 weights (W8A16)", "int8 KV cache", "int8 weights, GPTQ", "int8 weights, GPTQ, lm_head bf16",
                "w8a8, SmoothQuant, lm_head bf16"]


def _quant_quality():
    spec = importlib.util.spec_from_file_location("quant_quality", os.path.join(REPO_ROOT, "benchmarks", "quant_quality.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["quant_quality"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(smollm2_gguf):
    qq = _quant_quality()
    from jlight.loading.gguf_loader import open_gguf
    from jlight.loading.gguf_tokenizer import gguf_tokenizer

    # The tokenizer load_model(smollm2_gguf).tokenizer is (loading/__init__.load_gguf), without
    # dequantizing the weights for it; measure() loads the model itself.
    tokenizer = gguf_tokenizer(open_gguf(smollm2_gguf), smollm2_gguf)
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
            if (name, metric) in EDGE:
                marks = [pytest.mark.xfail(strict=False, raises=AssertionError, reason=EDGE[(name, metric)])]
            yield pytest.param(name, metric, marks=marks, id=f"{name}-{metric}")


@pytest.mark.parametrize("name,metric", list(_cases()))
def test_quality_against_bfloat16(rows, name, metric):
    row = rows[name]
    assert row["positions"] == NUM_TOKENS - 2  # every position of the two segments but their first
    if metric == "agreement":
        assert row["top1_agreement"] >= AGREEMENT_MIN, f"{name}: top-1 agreement {row['top1_agreement']:.4f}"
    else:
        assert abs(row["perplexity_change"]) <= PERPLEXITY_MAX_CHANGE, f"{name}: perplexity {row['perplexity_change']:+.4f}"


def test_gptq_keeps_its_margin_over_round_to_nearest(rows):
    """GPTQ with the lm_head int8 sits on the 97% bar; this floor is what it must not fall under."""
    assert rows["int8 weights, GPTQ"]["top1_agreement"] >= GPTQ_FLOOR
    assert rows["int8 weights, GPTQ"]["top1_agreement"] > rows["int8 weights (W8A16)"]["top1_agreement"] + 0.01


def test_quantized_configurations_differ_from_bfloat16(rows):
    """The comparison is not vacuous: every configuration really changes some predictions."""
    for name in CONFIG_NAMES:
        assert rows[name]["top1_agreement"] < 1.0 and rows[name]["perplexity_change"] != 0.0, name
