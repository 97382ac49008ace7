"""Resolves a HF hub id (e.g. "meta-llama/Llama-3.2-1B") to a local directory.

Uses huggingface_hub.snapshot_download when it is installed and the hub answers quickly;
otherwise fails with one message that says how to use a local directory instead.
"""
from __future__ import annotations

import os
import re
import urllib.request

from jlight.core.errors import ModelLoadError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_URL = "https://huggingface.co"
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name))


def hub_reachable(timeout_s: float = 3.0) -> bool:
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", HUB_URL), timeout=timeout_s).close()
        return True
    except Exception:  # DNS failure, refused connection, timeout, HTTP error: all mean "not usable"
        return False


def download_from_hub(repo_id: str) -> str:
    """Return the local snapshot directory of `repo_id` (config, tokenizer, safetensors)."""
    how = (
        f"download it elsewhere (huggingface-cli download {repo_id} --local-dir DIR) and pass DIR, "
        "or pass a local .gguf file"
    )
    try:
        # huggingface_hub (optional) loads only for hub downloads.
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id!r} is not a local path and huggingface_hub is not installed; {how}") from None
    try:  # a snapshot already in the local HF cache needs no network
        return snapshot_download(repo_id, allow_patterns=_PATTERNS, local_files_only=True)
    except Exception:  # not cached (the exact class varies across huggingface_hub versions)
        pass
    if not hub_reachable():
        raise ModelLoadError(f"{repo_id!r} is not a local path and the Hugging Face hub is unreachable; {how}")
    try:
        return snapshot_download(repo_id, allow_patterns=_PATTERNS)
    except Exception as e:  # repo not found, gated, network dropped mid-download
        raise ModelLoadError(f"could not download {repo_id!r} from the hub ({type(e).__name__}: {e}); {how}") from None
