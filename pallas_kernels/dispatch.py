"""Picks an implementation for each kernel: Pallas on GPU, the XLA reference elsewhere.

`attention_impl` / `matmul_impl` in the engine config override the choice
("auto", "reference", "pallas"). Every implementation has the reference's signature:

  write_kv(k_cache, v_cache, layer, k, v, slot_mapping) -> (k_cache, v_cache)
  paged_attention(q, k_cache, v_cache, layer, md, *, scale, sliding_window) -> out
  matmul(x, w, out_dtype=None) -> y

`moe_impl` names how MoE models compute their routed experts (models/moe.py: "auto", "pallas",
"ragged_dot", "gathered", "dense"); "auto" is resolved there, per call, from the backend and the
number of (token, expert) pairs.
"""
from typing import Callable, NamedTuple

import jax

from jlight.pallas_kernels import attention_reference, matmul_reference

IMPLS = ("auto", "reference", "pallas")


MOE_IMPLS = ("auto", "pallas", "ragged_dot", "gathered", "dense")  # models/moe.py implements them


class Kernels(NamedTuple):
    write_kv: Callable
    paged_attention: Callable
    matmul: Callable
    moe_impl: str = "auto"


def _check(name, impl):
    if impl not in IMPLS:
        raise ValueError(f"{name}={impl!r} is not one of {', '.join(IMPLS)}")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _use_pallas(impl: str) -> bool:
    return impl == "pallas" or (impl == "auto" and on_gpu())


def get_kernels(attention_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto") -> Kernels:
    _check("attention_impl", attention_impl)
    _check("matmul_impl", matmul_impl)
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={moe_impl!r} is not one of {', '.join(MOE_IMPLS)}")
    write_kv, attention = attention_reference.write_kv, attention_reference.paged_attention
    matmul = matmul_reference.matmul
    if _use_pallas(attention_impl):
        from jlight.pallas_kernels import paged_attention_pallas

        write_kv, attention = paged_attention_pallas.write_kv, paged_attention_pallas.paged_attention
    # "auto" keeps XLA's matmuls even on GPU: end to end on the H200 (Llama-3-8B shape, int8
    # weights, batch-1 decode) XLA's fused dequantize-dot took 4.49 ms per token against 6.82 ms
    # with the Pallas W8A16 kernels (docs/BENCHMARKS.md, 2026-11-29 12:21): a batch-1 step pads to
    # the 8-token bucket, which the GEMV path (<= 4 rows) does not take. matmul_impl="pallas" selects them.
    if matmul_impl == "pallas":
        from jlight.pallas_kernels import matmul_pallas

        matmul = matmul_pallas.matmul
    return Kernels(write_kv, attention, matmul, moe_impl)
