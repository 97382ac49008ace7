"""jlight's C++ kernels for the CPU (*_cpu.cc beside this file), compiled into one library and registered
with XLA's FFI: GGUF block-quantized matmuls (gguf_matmul_cpu) and decode attention (paged_attention_cpu).

The library is compiled once per machine with the system's C++ compiler (-O3 -march=native) into
`cache_dir`/kernels, under a name that hashes the sources, the compiler, the flags, jaxlib's FFI headers
and the CPU's instruction sets, so a cache shared between machines never loads code built for another
CPU. `load(cache_dir)` builds (or finds) it and registers its targets once per process; without a
compiler it says why and returns False, and the callers keep to the XLA references.
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

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("gguf_matmul_cpu.cc", "paged_attention_cpu.cc"))
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
# FFI target -> the library's handler symbol
TARGETS = {"jlight_gguf_q4_matmul": "JlightGgufQ4Matmul", "jlight_gguf_q8_matmul": "JlightGgufQ8Matmul",
           "jlight_gguf_q8_min_matmul": "JlightGgufQ8MinMatmul", "jlight_paged_attention_cpu": "JlightPagedAttentionCpu"}


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
    parts = []
    for source in SOURCES:
        with open(source, "rb") as f:
            parts.append(f.read())
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h"), "rb") as f:
        parts.append(f.read())
    for part in (*parts, version.encode(), " ".join(FLAGS).encode(), jax.__version__.encode(),
                 _cpu_features().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return os.path.join(cache_dir, "kernels", f"jlight_cpu_kernels-{key.hexdigest()[:16]}.so")


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
        done = subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {', '.join(SOURCES)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or not at all, for processes building it at the same time
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    logger.info("built jlight's CPU kernels in %.1f s: %s", time.perf_counter() - start, path)
    return path


# The library whose handlers XLA holds for the FFI targets: registered once per process (XLA refuses a
# second registration of a name), whichever cache it came from.
_registered: list = []
_lock = threading.Lock()


@functools.cache
def load(cache_dir: str) -> bool:
    """Build (once per machine) and register the kernels' FFI targets (once per process); False, with a
    warning saying why, where that cannot be done."""
    with _lock:
        if _registered:
            return True
        try:
            library = ctypes.cdll.LoadLibrary(build(cache_dir))
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("jlight's CPU kernels are unavailable, so GGUF weights are dequantized at load (float32 "
                           "decode reads 4 bytes a weight instead of ~0.6) and attention runs its XLA reference: %s", e)
            return False
        _registered.append(library)
        return True
