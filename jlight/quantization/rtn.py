"""Round-to-nearest int8 or fp8: the linear weights of a params tree as QuantizedWeight, W8A8Weight or
Fp8Weight (jlight/core/quantization.py), per output column, symmetric."""
import jax

from jlight.core.quantization import (
    LINEAR_WEIGHTS, QUANTIZABLE, QUANT_MODES, Fp8Weight, Mxfp4Weight, QuantizedWeight, W8A8Weight, quantize_fp8,
    quantize_int8)


def quantize_params(params: dict, mode: str, keep=None) -> dict:
    """Return a copy of a Llama-family params tree with its linear weights in int8 or fp8.

    mode "int8": weight-only QuantizedWeight (W8A16); "w8a8": W8A8Weight; "fp8": Fp8Weight (e4m3 values,
    scale = the column's amax / 448, saturated at +-448). MoE experts stay as they are in every mode.
    Stacked layer weights [L, in, out] become values [L, in, out], scales [L, out], so
    lax.scan slices both per layer. Norms, biases and the embedding table stay as they are.

    keep: names from QUANTIZABLE to leave in the model dtype, e.g. keep=("lm_head",), as
    vLLM, GPTQ, AWQ and compressed-tensors checkpoints usually do: the lm_head's error goes
    straight into the logits, where near-ties flip the top-1 token. The default () quantizes
    the lm_head too. Measured on SmolLM2-135M-Instruct (benchmarks/quant_quality.py, 3509
    positions, against bf16; docs/BENCHMARKS.md): keeping the lm_head raises top-1 agreement
    from 95.55% to 96.41% (int8) and from 87.69% to 88.52% (w8a8). Neither reaches issue #5's
    97%, so for int8 and w8a8 it is not the default. It costs memory: for Llama-3-8B, 1.05 GB of
    bf16 lm_head instead of 0.53 GB of int8. keep=None is () for int8 and w8a8 and ("lm_head",) for
    fp8, as vLLM's fp8 and HF's FP8 checkpoints do: e4m3's 3-bit mantissa costs the logits far more
    (SmolLM2-135M, W8A8-FP8: 85.67% top-1 agreement with an fp8 lm_head, 91.08% with a bf16 one).
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization mode={mode!r} is not one of {', '.join(QUANT_MODES)}")
    if keep is None:
        keep = ("lm_head",) if mode == "fp8" else ()
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    unknown = [name for name in keep if name not in QUANTIZABLE]
    if unknown:
        raise ValueError(f"keep={keep!r}: {', '.join(map(repr, unknown))} not in {', '.join(QUANTIZABLE)}")
    quantizer = {"int8": quantize_int8, "w8a8": lambda w: W8A8Weight(*quantize_int8(w)), "fp8": quantize_fp8}[mode]

    def quantize(name, w):
        if isinstance(w, QuantizedWeight):
            raise ValueError(f"params[{name!r}] is already quantized; pass the unquantized params")
        if w.ndim < 2:
            raise ValueError(f"params[{name!r}] has shape {w.shape}; expected [..., in, out]")
        return quantizer(w)

    def quantize_layers(layers: dict) -> dict:
        layers = dict(layers)
        for name in LINEAR_WEIGHTS:
            if name in layers and name not in keep:
                layers[name] = quantize(name, layers[name])
        return layers

    # The stacked layers, or a list of per-layer dicts (load_model(unstacked=True)); a hybrid model
    # (models/hybrid.py) has one such group a kind of layer instead of "layers".
    groups = ["layers"] if "layers" in params else [g for g, v in params.items() if isinstance(v, (dict, list))]
    out = dict(params)
    for group in groups:
        layers = params[group]
        out[group] = [quantize_layers(lp) for lp in layers] if isinstance(layers, list) else quantize_layers(layers)
    if "lm_head" in params and "lm_head" not in keep:
        out["lm_head"] = quantize("lm_head", params["lm_head"])
    return out


def stored_quantization(params) -> str | None:
    """The quantization mode of already-quantized weights ("int8", "w8a8" or "fp8": a converted checkpoint,
    a HF FP8 checkpoint; "mxfp4": an MXFP4 checkpoint's experts kept as stored), or None for float ones."""
    kept = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))
    if any(isinstance(w, Mxfp4Weight) for w in kept):
        return "mxfp4"
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    first = next((w for w in leaves if isinstance(w, QuantizedWeight)), None)
    if first is None:
        return None
    return "w8a8" if isinstance(first, W8A8Weight) else "fp8" if isinstance(first, Fp8Weight) else "int8"


def quantize_unless_stored(params: dict, mode: str | None, field: str = "quantization") -> dict:
    """params quantized in `mode` (None: as they are); weights already stored quantized in `mode` are
    taken as stored, in another mode a ValueError naming `field`."""
    stored = stored_quantization(params)
    if mode is None or stored == mode:
        return params
    if mode == "mxfp4":
        raise ValueError(f"{field}='mxfp4' keeps an MXFP4 checkpoint's experts (gpt-oss) as stored, and this model has "
                         f"none (its weights: {stored or 'float'}); drop the option or pass 'fp8' / 'int8'")
    if stored is not None:
        raise ValueError(f"{field}={mode!r}: the checkpoint's weights are already quantized as {stored!r}; drop the "
                         f"option (or pass {stored!r}), or convert the original weights again")
    return quantize_params(params, mode)
