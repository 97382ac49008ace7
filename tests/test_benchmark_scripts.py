"""The benchmark scripts that device runs depend on, smoke-run on CPU (tiny shapes), so that a
broken script is found here and not after a machine has been started for it."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_latency_runs_every_variant_from_one_loaded_model(tmp_path):
    # unrolled layers: an engine built from the script's shared LoadedModel must leave it usable
    # for the next variant (it once set loaded.params = None and every later variant failed).
    variants = "bf16-b8,bf16-b8-sep,int8-xla-b1,int8-pallas-b1"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_latency.py"), "--model-config", "tiny",
                    "--variants", variants, "--tokens", "8", "--layer-loop", "unroll", "--step-tokens", "16",
                    "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "decode_latency.json").read_text())
    assert list(result["variants"]) == variants.split(",")
    for name, row in result["variants"].items():
        assert "error" not in row, (name, row)
        assert row["ms"] > 0 and row["dispatch_ms"] > 0
        assert all(row[k] > 0 for k in ("transfer_unpacked_ms", "transfer_packed_ms", "call_on_device_inputs_ms",
                                        "back_to_back_ms"))
        assert row["prefill_step_ms"]["16"] > 0
    assert result["variants"]["int8-pallas-b1"]["buckets"][0] == 1
    assert result["variants"]["bf16-b8"]["buckets"][0] == 8
    # the same random model decodes the same greedy tokens with fused and separate projections
    assert len(result["variants"]["bf16-b8"]["greedy_tokens"]) == 16
    assert result["variants"]["bf16-b8"]["greedy_tokens"] == result["variants"]["bf16-b8-sep"]["greedy_tokens"]
    # fused projections (the default) read the same weights as separate ones (-sep)
    assert result["variants"]["bf16-b8"]["weight_bytes"] == result["variants"]["bf16-b8-sep"]["weight_bytes"]


def test_w8a16_mosaic_benchmark_checks_and_times_each_variant(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "w8a16_mosaic.py"), "--quick", "--shapes", "256x128",
                    "--variants", "i8 tk256 s4,default", "--xla-layouts", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "w8a16_mosaic.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["xla bf16", "xla int8 dequantize-dot", "xla int8 [in, out]",
                                         "mosaic i8 tk256 s4", "mosaic default"]
    for row in rows:
        assert "error" not in row, row
        assert row["us"] > 0
    assert all(row["rel_err"] < 4e-3 for row in rows[1:])
