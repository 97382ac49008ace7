"""The two probes behind the fused-decode-layer plan (docs/BENCHMARKS.md, thirteenth session),
smoke-run on CPU: the matmul chain (interpret mode, tiny shapes) and the grid barrier (lowered for CUDA)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_matmul_chain_checks_every_variant_it_times(tmp_path):
    # chained and --concat (one matmul per K over every layer): both must compute the same products
    for extra in ([], ["--concat"]):
        out = tmp_path / ("concat" if extra else "chain")
        _run("matmul_chain.py", "--quick", "--variants", "xla-int8,mosaic-i8", "--out", str(out), *extra)
        result = json.loads((out / "matmul_chain.json").read_text())
        assert result["concat"] == bool(extra)
        assert [r["variant"] for r in result["results"]] == ["xla-int8", "mosaic-i8"]
        for row in result["results"]:
            assert "error" not in row, row
            assert row["max_rel_err"] < 5e-3, row  # bf16 output rounding; a wrong tile would be O(1)
            assert row["wall_us_per_layer"] > 0 and row["host_ms"] > 0


def test_grid_barrier_kernels_lower_for_cuda(tmp_path):
    _run("grid_barrier.py", "--lower-only", "--programs", "4", "--designs", "counter,gather", "--scopes", "gpu",
         "--out", str(tmp_path))
    rows = json.loads((tmp_path / "grid_barrier.json").read_text())["rows"]
    assert [(r["design"], r["scope"]) for r in rows] == [("counter", "gpu"), ("gather", "gpu")]
    assert all(r["lowered_chars"] > 1000 for r in rows)
