"""`jlight convert MODEL -o DIR`: save a loaded (optionally quantized) model as an orbax checkpoint.

The directory it writes loads like any other model (`jlight.LLM(DIR)`, `--model DIR`), but
faster: each array is restored straight into its device sharding, already in the target dtype
and quantization. See jlight/loading/orbax_loader.py for the layout.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import time

from jlight import loading
from jlight.core.config import ModelConfig
from jlight.loading import orbax_loader
from jlight.quantization.gptq import gptq_quantize_params
from jlight.quantization.rtn import quantize_params, quantize_unless_stored
from jlight.quantization.smoothquant import smooth_params

DTYPES = ("bfloat16", "float16", "float32")
QUANTIZATIONS = ("int8", "w8a8", "fp8")  # weight-only int8, int8 weights and activations, or e4m3 weights
# Files beside a HF model's weights that a tokenizer or chat template may need.
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "generation_config.json", "chat_template*", "*.model", "vocab*", "merges.txt")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def model_config_to_hf_dict(config: ModelConfig) -> dict:
    """A HF-style config.json that ModelConfig.from_hf_dict reads back to an equal config (the
    family fields of ModelConfig.extra under their HF names)."""
    cfg = {
        **config.extra,
        "architectures": [config.architecture],
        "model_type": _MODEL_TYPES.get(config.architecture) or config.extra.get("model_type", "llama"),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
    }
    return cfg


def quantize(params: dict, mode: str | None) -> dict:
    """Round-to-nearest (quantization/rtn.py), the types jlight's matmuls take; weights already stored in
    `mode` (a HF FP8 checkpoint converted with fp8) are kept as they are."""
    if mode is not None and mode not in QUANTIZATIONS:
        raise ValueError(f"--quantization {mode!r} is not supported; choose one of {', '.join(QUANTIZATIONS)} or leave it out")
    return quantize_unless_stored(params, mode, field="--quantization")


def write_converted(directory: str, config: ModelConfig, params: dict, *, tokenizer_dir: str | None = None,
                    tokenizer=None, dtype: str, quantization: str | None, source: str, calibration: str | None = None) -> None:
    """Write config.json, tokenizer files and the orbax params checkpoint into `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_config_to_hf_dict(config), f, indent=1)
    _write_tokenizer_files(directory, tokenizer_dir, tokenizer)
    orbax_loader.save_params(
        directory, params,
        manifest_extra={"dtype": dtype, "quantization": quantization, "source": source, "calibration": calibration},
    )


def _write_tokenizer_files(directory: str, tokenizer_dir: str | None, tokenizer) -> None:
    """Copy a HF directory's tokenizer files, or write the loaded tokenizer HF-style (GGUF sources)."""
    copied = False
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for pattern in _TOKENIZER_GLOBS:
            for path in glob.glob(os.path.join(tokenizer_dir, pattern)):
                if os.path.isfile(path):
                    shutil.copy2(path, os.path.join(directory, os.path.basename(path)))
                    copied = True
    if not copied and tokenizer is not None:
        # jlight.tokenizer.Tokenizer wraps a `tokenizers` backend; Tokenizer.from_dir reads these back.
        tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
        cfg = {**tokenizer.special_tokens_map, "chat_template": tokenizer.chat_template}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": list(tokenizer.eos_token_ids)}, f, indent=1)


# Calibration: the text is cut into sequences of this many tokens (as measured, docs/BENCHMARKS.md).
CALIBRATION_SEGMENT_LEN = 512


def calibrated_quantize(loaded, calibration_path: str, mode: str) -> dict:
    """--calibration: quantize with the text in `calibration_path`, lm_head left in the model dtype.
      int8: GPTQ (jlight/quantization/gptq.py) picks the int8 values; the format and scales are those of
        round-to-nearest. On SmolLM2-135M-Instruct this was the one int8 setup that met issue #5's
        quality bar (97.21% top-1 agreement with bf16, +0.20% perplexity; round-to-nearest: 95.55%).
      w8a8: SmoothQuant (jlight/quantization/smoothquant.py, alpha 0.5) moves activation outliers into
        the weights, then round-to-nearest. SmolLM2: 94.10% / +0.89% (round-to-nearest: 87.69% / +3.14%).
    Both are for the plain Llama family (a clear error otherwise)."""
    if loaded.tokenizer is None:
        raise ValueError("--calibration needs the model's tokenizer to read the text; this model has none")
    with open(calibration_path, encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read())
    segments = [ids[i:i + CALIBRATION_SEGMENT_LEN] for i in range(0, len(ids), CALIBRATION_SEGMENT_LEN)]
    segments = [seg for seg in segments if len(seg) >= 2]
    if not segments:
        raise ValueError(f"--calibration {calibration_path}: the text has fewer than 2 tokens; give a few thousand tokens of text")
    try:
        if mode == "int8":
            return gptq_quantize_params(loaded.params, loaded.config, segments, keep=("lm_head",))
        return quantize_params(smooth_params(loaded.params, loaded.config, segments), mode, keep=("lm_head",))
    except NotImplementedError as e:
        raise ValueError(f"--calibration: {e}; convert without --calibration (round-to-nearest)") from e


CALIBRATION_METHODS = {"int8": "GPTQ", "w8a8": "SmoothQuant (alpha 0.5) + round-to-nearest"}


def convert(model: str | None, output_dir: str, *, dtype: str = "bfloat16", quantization: str | None = None,
            calibration: str | None = None) -> dict:
    """Load `model`, cast/quantize it, and write it to `output_dir`. Returns timing figures.

    calibration: a text file; with quantization "int8", GPTQ on it, with "w8a8", SmoothQuant on it
    (calibrated_quantize), instead of round-to-nearest alone."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if calibration is not None and quantization not in CALIBRATION_METHODS:
        raise ValueError(f"--calibration needs --quantization int8 (GPTQ) or w8a8 (SmoothQuant), got --quantization {quantization}")
    if calibration is not None and not os.path.isfile(calibration):
        raise ValueError(f"--calibration {calibration}: no such file; give a text file (a few thousand tokens of varied text)")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"-o {output_dir} is a file; give a directory to write the checkpoint into")
    if os.path.exists(output_dir) and os.listdir(output_dir) and not orbax_loader.is_orbax_model_dir(output_dir):
        raise ValueError(f"-o {output_dir} exists and is not a jlight checkpoint; pick an empty or new directory")
    start = time.perf_counter()
    loaded = loading.load_model(model, dtype=dtype)
    params = calibrated_quantize(loaded, calibration, quantization) if calibration else quantize(loaded.params, quantization)
    load_s = time.perf_counter() - start
    write_converted(
        output_dir, loaded.config, params,
        tokenizer_dir=loaded.name if os.path.isdir(loaded.name) else None,
        tokenizer=loaded.tokenizer,
        dtype=dtype, quantization=quantization, source=model or "default",
        calibration=f"{CALIBRATION_METHODS[quantization]} on {os.path.basename(calibration)}, lm_head in {dtype}" if calibration else None,
    )
    return {"load_s": load_s, "write_s": time.perf_counter() - start - load_s}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="HF model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("-o", "--output", required=True, help="directory to write the orbax checkpoint into")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the stored weights")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="store int8 or fp8 (e4m3, a scale per output channel) weights (quantized once, here; loading does not re-quantize)")
    parser.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                        help="with --quantization int8: choose the int8 values by GPTQ on this text; with w8a8: SmoothQuant "
                             "on it; the lm_head kept in --dtype (Llama family; host-side, measured on a 135M model only: "
                             "GPTQ 23 s on 2 CPU cores)")


def run(args: argparse.Namespace) -> int:
    times = convert(args.model, args.output, dtype=args.dtype, quantization=args.quantization, calibration=args.calibration)
    print(f"wrote {args.output} (load {times['load_s']:.1f}s, write {times['write_s']:.1f}s)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jlight convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
