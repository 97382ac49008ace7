"""The CPU kernel for GGUF block-quantized weights (jlight/core/gguf_weights.py): x times the weights
as the file stores them, in float32, through XLA's FFI (gguf_matmul_cpu.cc).

Batch-1 decode on the CPU is a chain of one-row matmuls that read every weight once: float32 weights
move 4 bytes a weight; kept as Q4_1 they move 0.625, and the kernel dequantizes each block in
registers (d * (x . values) + m * sum(x)), on XLA's intra-op threads, output channels split between
them. Same signature as matmul_reference.matmul for GGUF weights (the reference dequantizes them and
runs XLA's dot); dispatch sends steps of up to `gguf_kernel_max_rows` rows here.

The C++ source is compiled once per machine with the system's C++ compiler (-O3 -march=native) into
`cache_dir`, under a name that hashes the source, the compiler, the flags, jaxlib's FFI headers and the
CPU's instruction sets, so a cache shared between machines never loads code built for another CPU.
`load(cache_dir)` builds (or finds) it and registers the FFI targets; without a compiler it says why and
the engine dequantizes GGUF weights at load instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp

from jlight.core.gguf_weights import GGUFQ4Weight, GGUFQ8Weight

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_matmul_cpu.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = {GGUFQ4Weight: ("jlight_gguf_q4_matmul", "JlightGgufQ4Matmul"),
           GGUFQ8Weight: ("jlight_gguf_q8_matmul", "JlightGgufQ8Matmul")}


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)


def _cpu_features() -> str:
    """The CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_path(cache_dir: str, compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        source = f.read()
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h"), "rb") as f:
        ffi_api = f.read()
    for part in (source, version.encode(), " ".join(FLAGS).encode(), ffi_api, jax.__version__.encode(),
                 _cpu_features().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return os.path.join(cache_dir, "kernels", f"gguf_matmul_cpu-{key.hexdigest()[:16]}.so")


def build(cache_dir: str) -> str:
    """The path of the compiled library, compiling it first if the cache lacks it. Raises RuntimeError
    naming the compiler's complaint."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++ on PATH, or $CXX)")
    path = library_path(cache_dir, compiler)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or not at all, for processes building it at the same time
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    logger.info("built jlight's CPU kernel for GGUF weights in %.1f s: %s", time.perf_counter() - start, path)
    return path


# The library whose handlers XLA holds for the FFI targets: registered once per process (XLA refuses a
# second registration of a name), whichever cache it came from.
_registered: list = []
_lock = threading.Lock()


@functools.cache
def load(cache_dir: str) -> bool:
    """Build (once per machine) and register the kernel's FFI targets (once per process); False, with a
    warning saying why, where that cannot be done."""
    with _lock:
        if _registered:
            return True
        try:
            library = ctypes.cdll.LoadLibrary(build(cache_dir))
            for target, symbol in TARGETS.values():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("jlight's CPU kernel for GGUF weights is unavailable, so GGUF weights are dequantized "
                           "at load (float32 decode reads 4 bytes a weight instead of ~0.6): %s", e)
            return False
        _registered.append(library)
        return True


def matmul(x, w, out_dtype=None):
    """x [..., in] times a GGUFQ4Weight / GGUFQ8Weight ([out, in] blocks) -> [..., out] in out_dtype
    (default x's dtype), float32 math. Needs load() first."""
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.scales.shape[-2]), jnp.float32)
    target = TARGETS[type(w)][0]
    y = jax.ffi.ffi_call(target, out)(x2, *w)  # Q4: (blocks, scales, mins); Q8: (values_t, scales)
    return y.astype(out_dtype).reshape(*lead, out.shape[-1])
