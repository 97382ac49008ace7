"""Lower a Pallas (Triton backend) kernel for CUDA on a CPU-only machine and verify each Triton
module it produces, as the GPU's XLA will when it parses them.

Interpret-mode tests run the kernel's logic but not its Triton lowering, and
`jit(...).lower(lowering_platforms=("cuda",))` alone serializes a module without checking it: a
malformed one (e.g. an `scf.for` whose bounds have different types) is only rejected on the GPU.
"""
import contextlib

import jax
from jax._src.pallas.triton import pallas_call_registration


@contextlib.contextmanager
def _verifying_lowering(verified: list):
    lowering = pallas_call_registration.lowering
    original = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        result.module.operation.verify()  # raises with the MLIR diagnostic if malformed
        verified.append(result)
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def verified_triton_modules(fn, *args) -> int:
    """Lower jit(fn)(*args) for CUDA (args may be ShapeDtypeStructs); verify every Triton module.
    Returns how many were lowered, so a caller can assert the kernel path was taken at all."""
    return len(triton_module_texts(fn, *args))


def triton_module_texts(fn, *args) -> list[str]:
    """verified_triton_modules' lowering, returning each verified module's MLIR text."""
    verified = []
    with _verifying_lowering(verified):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return [str(result.module) for result in verified]
