"""Writes tiny HF checkpoints in the FP8 layouts jlight reads (loading/fp8_checkpoint.py), from a tiny
unquantized HF directory, quantized here with torch (not with jlight's code):

  "compressed-tensors-channel": llm-compressor's FP8 layout, `weight` float8_e4m3fn [out, in],
      `weight_scale` float32 [out, 1] = the row's amax / 448, a static `input_scale` scalar beside it;
      lm_head in `ignore`.
  "fp8-block": transformers' FineGrainedFP8 / DeepSeek-V3 layout, `weight_scale_inv` float32
      [ceil(out / 128), ceil(in / 128)] = each 128x128 block's amax / 448.
  "fp8-block-pow2": the same with each block scale rounded up to a power of two (the ue8m0-style
      scales of DeepSeek-V3.1's checkpoints, stored as float32 here).

Only the attention and MLP projections are quantized, as those checkpoints do.
"""
from __future__ import annotations

import json
import math
import os
import shutil

LINEAR_SUFFIXES = tuple(f"{m}.{p}.weight" for m, ps in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                        for p in (f"{x}_proj" for x in ps))
BLOCK = 128


def _channel(w):
    import torch

    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # [out, 1]
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _blocks(w, pow2: bool):
    import torch

    n, k = w.shape
    rows, cols = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            s = 2.0 ** torch.ceil(torch.log2(s)) if pow2 else s
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def dequantized_state(tensors: dict) -> dict:
    """The float32 weights an FP8 checkpoint's tensors stand for (weight * its scale), by name."""
    import torch

    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.float()
            continue
        base = name[: -len(".weight")]
        if base + ".weight_scale_inv" in tensors:
            s = tensors[base + ".weight_scale_inv"]
            full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: t.shape[0], : t.shape[1]]
        else:
            full = tensors[base + ".weight_scale"].reshape(-1, 1)
        out[name] = t.float() * full
    return out


def write_fp8_checkpoint(src: str, dst: str, layout: str) -> dict:
    """`src` (a tiny HF directory) rewritten to `dst` in `layout`; returns the tensors written."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if not name.endswith(LINEAR_SUFFIXES):
            tensors[name] = t
            continue
        w = t.float()
        if layout == "compressed-tensors-channel":
            tensors[name], tensors[name + "_scale"] = _channel(w)
            tensors[name[: -len(".weight")] + ".input_scale"] = torch.tensor([0.05])
        elif layout in ("fp8-block", "fp8-block-pow2"):
            tensors[name], tensors[name + "_scale_inv"] = _blocks(w, pow2=layout == "fp8-block-pow2")
        else:
            raise ValueError(layout)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    for f in os.listdir(src):
        if f != "model.safetensors" and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if layout == "compressed-tensors-channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}}}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tensors
