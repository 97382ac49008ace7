"""benchmarks/mesh_sweep.py smoke-run on CPU with simulated devices (a subprocess each: the device
count is fixed when JAX starts), so that the multi-GPU device call finds a working script: Llama
on tp=1/tp=2 with the communication variants, MoE families on expert-parallel meshes, and a
failing mesh recorded as an error row while the sweep goes on."""
import json
import math
import os
import subprocess
import sys

import pytest
from simulated_devices import simulated_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from model_configs import make_config  # noqa: E402

pytestmark = pytest.mark.extended  # README: `python -m pytest -m extended tests`


def sweep(tmp_path, num_devices: int, *args: str) -> dict:
    env = simulated_env(num_devices)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mesh_sweep.py"), "--quick", "--plot", "0",
                           "--out", str(tmp_path), "--name", "sweep", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "sweep.json").read_text())


def assert_timed(row: dict, steps=("decode_b1", "decode_b8", "ttft_256")):
    assert "error" not in row, row
    for step in steps:
        assert f"{step}_error" not in row, row
        for key in ("ms", "pipelined_ms"):
            assert math.isfinite(row[f"{step}_{key}"]) and row[f"{step}_{key}"] > 0, (row["label"], step, key)
        assert row[f"{step}_finite"], (row["label"], step)  # the logits
    if "decode_b8" in steps:
        assert row["decode_b8_tok_s"] > 0


def test_llama_tp1_tp2_one_layer_with_comm_variants(tmp_path):
    result = sweep(tmp_path, 2, "--model-config", "tiny", "--num-layers", "1", "--meshes", "tp=1,tp=2",
                   "--layer-loop", "unroll", "--collective-matmul", "1", "0", "--int8-all-reduce", "0", "1")
    assert result["num_layers"] == 1 and result["layer_loop"] == "unroll"
    rows = {r["label"]: r for r in result["results"]}
    assert list(rows) == ["tp=1", "tp=2 cm=1,i8=0", "tp=2 cm=1,i8=1", "tp=2 cm=0,i8=0", "tp=2 cm=0,i8=1"]
    for row in rows.values():
        assert_timed(row)
    # Collective matmul only changes the 256-token prefill; int8 all-reduce only where it is off.
    assert rows["tp=2 cm=1,i8=1"]["same_as"] == {"ttft_256": "cm=1,i8=0"}
    assert rows["tp=2 cm=0,i8=0"]["same_as"] == {"decode_b1": "cm=1,i8=0", "decode_b8": "cm=1,i8=0"}
    assert "same_as" not in rows["tp=2 cm=1,i8=0"]


def test_deepseek_v3_expert_parallel(tmp_path):
    # 1 dense + 1 MoE layer (MLA latent cache, 16 routed experts + a shared one), stacked under
    # scan; two step shapes only, to keep the test short.
    result = sweep(tmp_path, 2, "--model-config", "tiny-deepseek-v3", "--num-layers", "2", "--meshes", "ep=1", "ep=2",
                   "--steps", "decode_b1", "ttft")
    assert (result["family"], result["num_layers"], result["num_dense_layers"]) == ("deepseek", 2, 1)
    assert [r["label"] for r in result["results"]] == ["ep=1", "ep=2"]
    for row in result["results"]:
        assert_timed(row, steps=("decode_b1", "ttft_256"))
        assert "decode_b8_ms" not in row


def test_mixtral_unrolled_ep2_and_a_failing_mesh_is_an_error_row(tmp_path):
    result = sweep(tmp_path, 2, "--model-config", "tiny-mixtral", "--meshes", "ep=4", "ep=2", "--layer-loop", "unroll")
    failed, ok = result["results"]
    assert failed["mesh"] == "ep=4" and "needs 4 devices" in failed["error"]
    assert ok["mesh"] == "ep=2"
    assert_timed(ok)


def test_named_shapes():
    c = make_config("llama3-70b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size, c.rope_theta) == (8192, 28672, 80, 64, 8, 128, 128256, 500000.0)
    assert make_config("llama3-70b", num_layers=40).num_layers == 40
    assert make_config("llama3-8b") == make_config("llama3-8b", 8192)  # the old default
    ds = make_config("deepseek-v3", num_layers=7)
    assert ds.architecture == "DeepseekV3ForCausalLM" and ds.extra["n_routed_experts"] == 256
    assert ds.extra["first_k_dense_replace"] == 3  # the real model's dense first layers
    assert make_config("deepseek-v3", num_layers=2).extra["first_k_dense_replace"] == 1  # one MoE layer stays
    assert make_config("deepseek-v3", num_layers=3, num_dense_layers=1).extra["first_k_dense_replace"] == 1
    assert make_config("mixtral-8x7b", num_layers=8).extra["num_local_experts"] == 8
