"""The benchmark toolbox smoke-run on CPU with tiny shapes, so that a broken script is found here and not
after a GPU machine has been started for it: the harness (the peer's requests, the device rates, the result
header), the scripts the GPU runner calls (in this process, to import JAX once) and gpu.sh's suite parsing."""
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import harness

    return harness


def test_harness_builds_the_peers_requests_call_for_call(bench):
    # ../shared/peer/vllm_bench.py's calls, in its order, on the global generator: the harness must give
    # the same prompts and lengths (so jlight and vLLM run the same work).
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    nano = bench.nano_workload()
    assert [r.prompt_token_ids for r in nano] == prompts and [r.max_tokens for r in nano] == max_tokens
    assert {r.temperature for r in nano} == {0.6}
    random.seed(1)
    assert bench.bs1_prompt() == [random.randint(0, 10000) for _ in range(128)]
    random.seed(2)
    fixed = bench.fixed_workload(30, 7, 5)
    assert [r.prompt_token_ids for r in fixed] == [[random.randint(0, 10000) for _ in range(30)] for _ in range(5)]
    assert {r.max_tokens for r in fixed} == {7}
    # vllm_growth.py: its prompts, and its cases (batch x length above 300,000 tokens skipped)
    assert bench.growth_ttft_prompt(5) == [5, 12, 19, 26, 33]
    assert bench.growth_decode_prompts(3, 2) == [[3, 14, 25], [4, 15, 26]]
    assert bench.growth_cases() == [(1024, 1), (1024, 16), (2048, 1), (2048, 16), (4096, 1), (4096, 16), (8192, 1),
                                    (8192, 16), (16384, 1), (16384, 16), (32000, 1)]
    assert bench.GROWTH_ENGINE["enable_prefix_caching"] is False


def test_harness_times_generate_calls_the_peers_way(bench):
    calls = []

    def generate(requests):  # a fake engine: 1 s plus 10 ms a token after the first
        calls.append([(len(r.prompt_token_ids), r.max_tokens) for r in requests])
        n = requests[0].max_tokens
        return 1.0 + 0.01 * (n - 1), n * len(requests)

    assert bench.bs1_ms_per_token(generate, [1] * 128) == pytest.approx(10.0)
    assert calls == [[(128, 1)], [(128, 256)]] * 3
    calls.clear()
    assert bench.growth_decode_ms_per_step(generate, 4, 3) == pytest.approx(10.0)  # (t(66) - t(2)) / 64
    assert calls == [[(4, 2)] * 3, [(4, 66)] * 3]


def test_copy_rate_times_a_plain_copy_and_results_carry_their_header(bench, tmp_path):
    import jax
    import jax.numpy as jnp

    hlo = jax.jit(jnp.copy).lower(jnp.zeros((256,), jnp.float32)).compile().as_text()
    assert " copy(" in hlo and " add(" not in hlo and " multiply(" not in hlo
    assert bench.copy_bytes_per_s(1 << 20, reps=2) > 0 and bench.matmul_flops_per_s(64, reps=2) > 0
    path = bench.write_result(str(tmp_path), "r", {"figure": 1.5, "device": "mine"})
    result = json.loads(open(path).read())
    assert result["figure"] == 1.5 and result["device"] == "mine"  # the result's own keys win
    assert {"date", "backend", "jax", "command", "git_commit"} <= set(result)
    assert bench.write_result(None, "r", {}) is None


def test_offline_throughput_runs_the_peers_workloads_in_one_engine(bench, tmp_path):
    import offline_throughput

    result = offline_throughput.main([
        "--model-config", "tiny", "--num-requests", "6", "--input-len", "10", "40", "--output-len", "3", "9",
        "--fixed", "20", "5", "3", "--bs1-tokens", "6", "--max-num-seqs", "8", "--max-model-len", "192",
        "--max-num-batched-tokens", "64", "--min-token-bucket", "64", "--step-trace", "--out", str(tmp_path)])
    nano = bench.nano_workload(6, (10, 40), (3, 9))
    assert result["nano"]["output_tokens"] == sum(r.max_tokens for r in nano)  # ignore_eos: every token generated
    assert result["nano"]["input_tokens"] == sum(len(r.prompt_token_ids) for r in nano)
    assert result["fixed"]["output_tokens"] == 15 and result["fixed"]["input_tokens"] == 60
    assert result["bs1"]["ms_per_token"] > 0 and result["init_s"] > 0 and result["buckets"] == [64]
    assert sum(g["steps"] for g in result["step_trace"]) == result["nano"]["steps"]  # every step of the run traced
    # every step launched a warmed-up executable; the launches' spread and the slowest calls' phases are reported
    assert result["nano"]["steps_compiled_during_run"] == 0 == result["fixed"]["steps_compiled_during_run"]
    launch = result["nano"]["launch_ms"]
    assert 0 < launch["median"] <= launch["p90"] <= launch["max"]
    slowest = result["nano"]["slowest_step_calls_phases_ms"]
    assert len(slowest) == 3 and all(c["call"] >= c["launch"] for c in slowest)
    saved = json.loads((tmp_path / "offline_throughput.json").read_text())
    assert saved["fixed"] == result["fixed"] and "git_commit" in saved


def test_steps_compiled_by_jit_counts_the_steps_a_run_compiles_outside_warm_up(bench):
    from jlight.engine.sampling_params import SamplingParams

    engine = bench.random_engine("tiny", "float32", max_model_len=192, max_num_seqs=8, max_num_batched_tokens=64,
                                 min_token_bucket=64, warmup=False)
    calls = bench.spy_on_step_calls(engine)
    engine.add_request("a", None, SamplingParams(max_tokens=3), prompt_token_ids=[3, 4, 5])
    while engine.has_unfinished_requests():
        engine.step()
    bench.stop_spying(engine)
    assert bench.steps_compiled_by_jit(engine) == 1  # the one bucket, compiled at its first launch
    # one call a step, and one more that only read the last step back; the compile sat in the first launch
    assert len(calls) == engine.num_steps + 1 and "step" not in engine.__dict__
    assert max(calls, key=lambda c: c[1]["launch"]) is calls[0]


def test_spy_on_launches_records_each_launch_and_tells_a_launch_that_waited_on_the_device(bench):
    from jlight.engine.sampling_params import SamplingParams

    engine = bench.random_engine("tiny", "float32", max_model_len=192, max_num_seqs=8, max_num_batched_tokens=64,
                                 min_token_bucket=64)
    records = bench.spy_on_launches(engine)
    engine.add_request("a", None, SamplingParams(max_tokens=4), prompt_token_ids=[3, 4, 5])
    while engine.has_unfinished_requests():
        engine.step()
    bench.stop_spying(engine)
    assert len(records) == engine.num_steps and "launch" not in engine.runner.__dict__
    assert records[0][:2] == (True, True)  # nothing ran before the first launch
    assert all(r[3] == (64, r[3][1], False) for r in records)  # the one bucket of this engine
    # Three launches begun with the device busy: two waited for it (returned with it done), one did not; of the
    # two slow ones (over 5x the median), one ran another compiled step than the launch before it.
    a, b = (8, 16, False), (64, 16, False)
    waits = bench.launch_waits([(False, True, 0.011, a), (False, True, 0.012, b), (False, False, 0.001, b), (True, True, 0.002, b),
                                (True, True, 0.002, b), (True, True, 0.001, b)], listed=1)
    assert {k: v for k, v in waits.items() if k != "slow"} == {
        "launches": 6, "began_with_device_busy": 0.5, "of_those_returned_with_it_done": 0.667,
        "median_ms_device_busy_at_start": 11.0, "median_ms_device_idle_at_start": 2.0}
    assert waits["slow"] == {"over_ms": 10.0, "count": 2, "total_ms": 23.0, "after_another_variant": 1,
                             "first": [[0, None, list(a), 11.0]]}


def test_offline_throughput_profiles_a_window_of_steps(bench, tmp_path):
    import offline_throughput

    result = offline_throughput.main([
        "--model-config", "tiny", "--num-requests", "6", "--input-len", "10", "40", "--output-len", "3", "9",
        "--bs1-tokens", "0", "--max-num-seqs", "8", "--max-model-len", "192", "--max-num-batched-tokens", "64",
        "--min-token-bucket", "64", "--profile-steps", "2", "3", "--out", str(tmp_path)])
    profile = result["nano"]["profile"]
    assert profile["dir"] == str(tmp_path / "profile") and list(tmp_path.glob("profile/plugins/profile/*/perfetto_trace.json.gz"))
    hot = profile["hotspots"]
    # the window holds the engine's step calls and the runtime's work under them, the largest self time first; a
    # frame's self time leaves out what it encloses (the step() frames enclose the whole window's work)
    assert hot[0]["self_ms"] >= hot[-1]["self_ms"] >= 0 and 5 < len(hot) <= 25
    every = bench.trace_hotspots(profile["dir"], top=10_000)
    assert any("step" in h["name"] for h in every)
    # which frames reach the top 25 depends on the host's speed; the enclosing frames are in the whole list
    assert all(0 <= h["self_ms"] <= h["ms"] + 1e-6 for h in every) and any(h["self_ms"] < 0.5 * h["ms"] for h in every)
    assert result["nano"]["steps_compiled_during_run"] == 0


def test_offline_throughput_with_a_host_tier_reports_its_counters_and_copy_rates(bench, tmp_path):
    """A device pool of 12 pages for 6 requests of up to 48 tokens: preemptions evict pages to the host tier."""
    import offline_throughput

    result = offline_throughput.main([
        "--model-config", "tiny", "--num-requests", "6", "--input-len", "20", "40", "--output-len", "3", "8",
        "--bs1-tokens", "0", "--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "64",
        "--min-token-bucket", "64", "--num-pages", "12", "--kv-offloading-size", "0.001", "--out", str(tmp_path)])
    tier, rates = result["host_tier"], result["host_copy_bytes_per_s"]
    assert tier["host_cache_pages_total"] > 0 and tier["host_cache_offloaded_pages"] > 0
    assert rates["memory_kind"] == "pinned_host" and rates["device_to_host"] > 0 and rates["host_to_device"] > 0


def test_random_mxfp4_experts_run_as_stored_and_compute_their_expansion(bench):
    """--quantization mxfp4 on a MoE shape: random MXFP4 experts that the engine runs as stored, and whose expansion gives the same greedy tokens as an engine given
    the expanded weights."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import model_configs

    from families_common import engine_greedy_tokens
    from jlight.core.quantization import Mxfp4Weight, dequantize_mxfp4

    loaded = model_configs.random_loaded_model("tiny-gpt-oss", jnp.float32, mxfp4=True)
    kept = {k: w for k, w in loaded.params["layers"].items() if isinstance(w, Mxfp4Weight)}
    assert sorted(kept) == ["experts_down", "experts_gate", "experts_up"]
    assert all(w.blocks.dtype == jnp.uint8 and w.shape[-2] % 32 == 0 for w in kept.values())
    expanded = dataclasses.replace(loaded, params=dict(loaded.params, layers={
        **loaded.params["layers"], **{k: dequantize_mxfp4(w, jnp.float32) for k, w in kept.items()}}))
    engines = [bench.random_engine("tiny-gpt-oss", "float32", loaded=m, max_model_len=64, max_num_seqs=2, num_pages=32,
                                   quantization=q, compilation_cache_dir=None, warmup=False)
               for m, q in ((loaded, "mxfp4"), (expanded, None))]
    ran = [w for w in jax.tree.leaves(engines[0].runner.params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))
           if isinstance(w, Mxfp4Weight)]
    assert ran and all(w.blocks.dtype == jnp.uint8 for w in ran)
    prompts = [list(range(3, 23)), list(range(40, 47))]
    tokens = [engine_greedy_tokens(e, prompts, 8) for e in engines]
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[0])


def test_decode_latency_variants_share_one_random_model(bench, tmp_path):
    # An engine built from the script's shared LoadedModel must leave it usable for the next variant, and fused
    # projections (the default) must decode the same greedy tokens from the same weights as separate ones.
    import decode_latency

    decode_latency.main(["--model-config", "tiny", "--variants", "bf16-b8,bf16-b8-sep,bf16-b8-packed", "--tokens", "6",
                         "--step-tokens", "8", "--out", str(tmp_path)])  # 8: the bucket decode compiled
    result = json.loads((tmp_path / "decode_latency.json").read_text())
    rows = result["variants"]
    assert list(rows) == ["bf16-b8", "bf16-b8-sep", "bf16-b8-packed"] and "git_commit" in result
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["ms"] > 0 and row["back_to_back_ms"] > 0 and row["prefill_step_ms"]["8"] > 0
        assert row["buckets"][0] == 8
        # the trivial call takes as many arrays as the step (the tiny model's 2 layers: a dozen and more)
        assert row["step_arrays"] > 12 and row["call_step_arrays_ms"] > 0 and row["call_one_array_ms"] > 0
    assert rows["bf16-b8"]["step_arrays"] < rows["bf16-b8-sep"]["step_arrays"]  # fused projections: fewer arrays
    # the small vectors grouped (pack_small_params): fewer arrays still, the same tokens
    assert rows["bf16-b8-packed"]["step_arrays"] < rows["bf16-b8"]["step_arrays"]
    assert rows["bf16-b8-packed"]["greedy_tokens"] == rows["bf16-b8"]["greedy_tokens"]
    assert len(rows["bf16-b8"]["greedy_tokens"]) == 16
    assert rows["bf16-b8"]["greedy_tokens"] == rows["bf16-b8-sep"]["greedy_tokens"]
    assert rows["bf16-b8"]["weight_bytes"] == rows["bf16-b8-sep"]["weight_bytes"]


def test_batch_decode_profile_times_a_full_decode_batch(bench, tmp_path):
    import batch_decode_profile

    batch_decode_profile.main(["--model-config", "tiny", "--batches", "3", "--context", "20", "--engine-steps", "2", "--max-num-batched-tokens", "8",
                               "--out", str(tmp_path)])
    row = json.loads((tmp_path / "batch_decode_profile.json").read_text())["rows"]["3"]
    assert row["step_ms"] > 0 and row["engine"]["tok_s"] > 0


def test_kernels_large_pool_section_checks_each_layer_against_the_reference(bench, tmp_path):
    import kernel_bench

    kernel_bench.main(["--quick", "--skip-checks", "--sections", "large_pool", "--check-impls", "triton", "--trials", "1",
                      "--out", str(tmp_path)])
    rows = [r for r in json.loads((tmp_path / "kernels.json").read_text())["timings"] if "pool" in r["kernel"]]
    assert len(rows) == 2 and all(0 < r["rel_err"] < 1e-2 for r in rows), rows  # bf16 rounding; a wrong page is O(1)


def test_step_trace_gives_each_step_the_wait_of_the_call_after_it(monkeypatch):
    # The engine runs one step ahead, so call k's wait is step k-1's device time; a step must get the
    # duration of the call after the one that scheduled it, and land in the group its plan says.
    monkeypatch.syspath_prepend(BENCH)
    from types import SimpleNamespace

    import step_trace

    row = lambda start, n: SimpleNamespace(start=start, num_tokens=n)  # noqa: E731
    plans = iter([[row(0, 40), row(0, 20)], [row(40, 1), row(20, 1)], [row(41, 1)], []])
    durations = iter([0.001, 0.004, 0.002, 0.003])
    clock = [0.0]
    monkeypatch.setattr(step_trace, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = SimpleNamespace(scheduler=SimpleNamespace(schedule=lambda: SimpleNamespace(rows=(r := next(plans)),
                                                                                         num_tokens=sum(x.num_tokens for x in r))),
                             runner=SimpleNamespace(buckets=[8, 64]))

    def step():
        engine.scheduler.schedule()
        clock[0] += next(durations)

    engine.step = step
    trace = step_trace.StepTrace().install(engine)
    for _ in range(4):
        engine.step()
    steps = trace.steps()
    assert [(s["rows"], s["bucket"], s["prefill_tokens"], s["context_tokens"]) for s in steps] == [
        (2, 64, 60, 60), (2, 8, 0, 62), (1, 8, 0, 42)]
    assert [round(s["seconds"], 6) for s in steps] == [0.004, 0.002, 0.003]
    groups = trace.summary(weight_bytes=1000, kv_bytes_per_token=10, num_params=1, copy_bytes_per_s=1e6,
                           matmul_flops_per_s=1e12)
    assert [(g["group"], g["steps"]) for g in groups] == [("with prefill", 1), ("decode 1-1 seqs", 1), ("decode 2-8 seqs", 1)]
    assert abs(groups[2]["roofline_s"] - (1000 + 620) / 1e6) < 1e-12
    assert abs(groups[2]["efficiency"] - 1.62e-3 / 0.002) < 1e-9
    assert groups[2]["padding_s"] == 0 and abs(groups[2]["passes_s"] - 1.62e-3) < 1e-12  # the weights' bytes bound
    # Compute-bound matmuls (2 x 1e6 FLOPs a token at 1 GFLOP/s): 2 real tokens take 4 ms, the 8-token bucket 16 ms.
    groups = trace.summary(weight_bytes=1000, kv_bytes_per_token=10, num_params=10**6, copy_bytes_per_s=1e6,
                           matmul_flops_per_s=1e9)
    assert abs(groups[2]["padding_s"] - 12e-3) < 1e-12 and abs(groups[2]["passes_s"] - (4e-3 + 620 / 1e6)) < 1e-12


def test_gpu_sh_gives_each_suite_its_own_arguments(tmp_path):
    def _gpu_sh(*args):  # DRY_RUN: each suite prints its command and runs nothing
        return subprocess.run(["bash", os.path.join(BENCH, "gpu.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path)))

    out = _gpu_sh("decode", "--variants", "int8-auto-b8", "context", "--lengths", "1024", "kernels", "--skip-checks",
                  "--", "throughput", "--sections", "decode")
    assert out.returncode == 0, out.stderr
    commands = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if "(timeout" in line]
    assert len(commands) == 4, out.stdout
    assert commands[0].startswith("python3 benchmarks/decode_latency.py") and commands[0].endswith(
        "--variants int8-auto-b8 (timeout 400 s)")
    assert commands[1].startswith("python3 benchmarks/context_sweep.py") and "--lengths 1024 (" in commands[1]
    assert commands[2].startswith("python3 benchmarks/kernel_bench.py") and commands[2].endswith("--skip-checks (timeout 480 s)")
    # a suite name right after an option is that option's value, not a suite
    assert commands[3].startswith("python3 benchmarks/offline_throughput.py") and "--sections decode (" in commands[3]
    # a suite named again (an A/B in one call) writes into a folder of its own
    out = _gpu_sh("throughput", "--bs1-tokens", "0", "throughput", "--engine-options", "{}", "throughput")
    commands = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if "(timeout" in line]
    outs = [c.split("--out ", 1)[1].split()[0] for c in commands]
    assert out.returncode == 0 and outs == [f"{tmp_path}/throughput", f"{tmp_path}/throughput_2/throughput",
                                             f"{tmp_path}/throughput_3/throughput"], out.stdout
    assert "--engine-options {} (" in commands[1] and "--engine-options" not in commands[2]
    assert _gpu_sh("no-such-suite").returncode == 2
    usage = _gpu_sh()
    assert usage.returncode == 2 and "SUITE" in usage.stdout


@pytest.mark.extended  # a GPU script's CPU smoke run
def test_context_sweep_measures_the_growth_cases_in_one_engine(bench, tmp_path):
    import context_sweep

    context_sweep.main(["--model-config", "tiny", "--dtype", "float32", "--max-model-len", "256", "--lengths", "40,300",
                        "--no-warmup", "--engine-options", '{"prompt_logprobs_program": true}', "--out", str(tmp_path)])
    result = json.loads((tmp_path / "context_bf16_256.json").read_text())
    assert list(result["ttft"]) == ["40"]  # 300 tokens and 66 new ones do not fit 256 positions
    for key in ("ttft", "decode_b1", "decode_b16", "line_b1", "line_b16"):
        assert result[key]["40"] > 0, key
    assert result["kv_bytes_per_token"] == 2 * 2 * 16 * 4 * 2  # K and V, 2 KV heads x 16 dims, float32, 2 layers
    assert result["command"] and result["date"]


@pytest.mark.extended  # a GPU script's CPU smoke run
def test_attention_decode_times_the_kernel_variants(bench, tmp_path):
    import attention_decode

    attention_decode.main(["--quick", "--variants", "mosaic work items", "--engine-pool-gib", "0.01", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "attention_decode.json").read_text())["rows"]
    assert all("error" not in r and r["us"] > 0 for r in rows)
    plain = [r for r in rows if "layout" not in r]
    assert {r["impl"] for r in plain} == {"mosaic work items", "xla reference"}
    assert all(r["max_abs_diff_vs_first"] < 2e-2 for r in plain)  # the reference agrees with the kernel
    # the same pages moved into an engine-sized pool (in order, scattered) give the same output
    assert [r["layout"] for r in rows if "layout" in r] == [
        "small pool, 1 layer", "engine pool, pages in order", "engine pool, pages scattered"]
    assert all(r["max_abs_diff_vs_small"] == 0.0 for r in rows if "layout" in r)


def test_ngram_prompt_is_the_peers_and_gpu_sh_runs_the_spec_suite(bench, tmp_path):
    random.seed(3)  # vllm_spec.py's calls, on the global generator
    unit = [random.randint(0, 10000) for _ in range(64)]
    assert bench.ngram_prompt() == (unit * 16)[:1024] and bench.ngram_prompt(100) == (unit * 2)[:100]
    out = subprocess.run(["bash", os.path.join(BENCH, "gpu.sh"), "spec", "--ks", "0,3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path)))
    assert out.returncode == 0 and "benchmarks/spec_decode.py --model-config llama3-8b" in out.stdout, out.stdout
    assert "--ks 0,3 (timeout 300 s)" in out.stdout


_FAKE_VLLM = '''
import time
__version__ = "fake"
class SamplingParams:
    def __init__(self, **kw): self.kw = kw
class Metric:
    def __init__(self, name, value=None, values=None): self.name, self.value, self.values = name, value, values
class LLM:
    def __init__(self, **kw): self.kw, self.tokens = kw, 0
    def generate(self, prompts, params, use_tqdm=False):
        assert prompts[0]["prompt_token_ids"] == PROMPT, "not harness.ngram_prompt's ids"
        time.sleep(5e-3 * params.kw["max_tokens"])  # 35 ms between 1 and 8 tokens: far above a loaded CI's jitter
        self.tokens += params.kw["max_tokens"]
    def get_metrics(self):
        n = self.tokens
        return [] if self.kw["speculative_config"] is None else [
            Metric("vllm:spec_decode_num_drafts", n), Metric("vllm:spec_decode_num_draft_tokens", 2 * n),
            Metric("vllm:spec_decode_num_accepted_tokens", n), Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[n, 0])]
'''


def test_vllm_spec_runs_off_then_on_and_reads_the_acceptance_counters(bench, tmp_path):
    # vLLM and numba stand-ins: the script's own logic (its two processes, prompt, timing and counters) runs as on the GPU.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(f"PROMPT = {bench.ngram_prompt(100)}\n" + _FAKE_VLLM)
    (tmp_path / "numba.py").write_text("")
    out = subprocess.run([sys.executable, os.path.join(BENCH, "vllm_spec.py"), "--prompt-len", "100", "--max-tokens", "8",
                          "--num-speculative-tokens", "2"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    off, on = [r["ngram"] for r in records if "ngram" in r]
    assert (off["spec"], on["spec"]) == ("off", "on") and off["ms_per_token"] > 0 and "ngram_speedup" in records[-1]
    assert off["acceptance"]["drafts"] is None  # no counter: no figure, and the timing stands
    assert on["speculative_config"]["num_speculative_tokens"] == 2
    assert on["acceptance"]["drafts"] == 3 * (8 + 1)  # the timed calls' growth only: 3 pairs of 1 + 8 tokens
    assert on["acceptance"]["mean_acceptance_length"] == 2.0 and on["acceptance"]["draft_acceptance_rate"] == 0.5


@pytest.mark.extended  # a GPU script's CPU smoke run (~50 s, compiles dominate)
def test_spec_decode_times_verify_steps_and_ngram_speculation(bench, tmp_path):
    import spec_decode

    result = spec_decode.main(["--model-config", "tiny", "--contexts", "32", "--ks", "1,3", "--trials", "1", "--reps", "2",
                               "--prompt-len", "96", "--max-tokens", "12", "--repeats", "1", "--max-model-len", "256",
                               "--sections", "verify,ngram,batch", "--batches", "1,3", "--out", str(tmp_path)])
    rows = result["verify"]["32"]["rows"]
    assert list(rows) == ["0", "1", "3"] and all(r["step_ms"] > 0 and r["synced_step_ms"] > 0 for r in rows.values())
    assert [r["query_tokens"] for r in rows.values()] == [1, 2, 4] and rows["0"]["ratio_to_k0"] == 1.0
    assert "speedup_at_eagle3_acceptance" in rows["3"] and "speedup_at_eagle3_acceptance" not in rows["1"]
    ngram = result["ngram"]
    assert ngram["off"]["acceptance"]["drafts"] == 0 and ngram["on"]["speculative_config"]["method"] == "ngram"
    assert ngram["off"]["ms_per_token"] > 0 and ngram["on"]["ms_per_token"] > 0 and ngram["speedup"] > 0
    assert json.loads((tmp_path / "spec_decode.json").read_text())["ngram"]["on"] == ngram["on"]
    batch = result["batch"]
    assert list(batch["speedup"]) == ["1", "3"] and all(r > 0 for r in batch["speedup"].values())
    assert batch["on"]["speculative_config"]["disable_by_batch_size"] == 3  # speculating at every batch
    assert all(r["acceptance"]["drafts"] > 0 for r in batch["on"]["rows"].values())
    assert all(r["acceptance"]["drafts"] == 0 and r["output_tok_s"] > 0 for r in batch["off"]["rows"].values())


def test_multi_turn_runs_the_conversations_with_the_host_tier_off_and_on_and_all_on_the_device(bench, tmp_path):
    # The smoke run's device pool holds less than the round-robin touches between two turns of one conversation:
    # with the tier on, histories come back from the host (hits > 0) and the greedy replies are the recomputed ones.
    import multi_turn

    result = multi_turn.main(["--smoke", "--in-process", "--out", str(tmp_path)])
    off, on, device = result["runs"]["off"], result["runs"]["on"], result["runs"]["device"]
    assert result["comparison"]["same_tokens"] and off["reply_digests"] == on["reply_digests"]
    assert result["comparison"]["on_replies_matching_device"] == 1.0 and device["reply_digests"] == on["reply_digests"]
    # The device run's pool holds every history: all its hits are the device's, at least the tier run's total.
    assert device["host_cache_hit_tokens"] == 0 and device["cached_prompt_tokens"] >= on["cached_prompt_tokens"]
    assert off["host_cache_hit_tokens"] == 0 and "host_tier" not in off
    assert on["host_cache_hit_tokens"] > 0 and on["host_tier"]["pages_to_host"] > 0
    assert on["host_tier"]["pages_to_device"] * 8 == on["host_cache_hit_tokens"]  # 8-token pages
    assert on["host_tier"]["reserved_gib"] == 0  # the CPU takes no pinned memory at warm-up
    assert on["cached_prompt_tokens"] == on["device_cache_hit_tokens"] + on["host_cache_hit_tokens"] > off["cached_prompt_tokens"]
    for run in (off, on):
        assert run["turns"] == 8 * 3 and run["output_tokens"] == 8 * 3 * 6 and run["preemptions"] == 0
        assert len(run["ttft_ms_median_by_turn"]) == 3 and 0 < run["ttft_ms"]["median"] <= run["ttft_ms"]["p99"]
    assert result["host_copy_bytes_per_s"]["device_to_host"] > 0 and result["pcie_gen5_x16_bytes_per_s"] == 64e9
    for run in (off, on):  # the slowest calls by index, for --profile-steps
        index = run["slowest_step_calls_index"]
        assert len(index) == len(run["slowest_step_calls_ms"]) == len(set(index)) and all(0 <= i for i in index)
    saved = json.loads((tmp_path / "multi_turn.json").read_text())
    assert saved["comparison"] == result["comparison"] and "git_commit" in saved


def test_vllm_dummy_weights_send_every_token_to_the_same_experts_where_the_router_has_a_bias(bench):
    """The reason offline_throughput takes --init vllm-dummy beside vLLM's dummy run of gpt-oss: under vLLM's
    uniform(-1e-3, 1e-3) weights the router's bias decides the experts alone, under jlight's normal ones the tokens."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(7), (64, 64))  # the residual stream of 64 tokens, embed 64

    def chosen_sets(init):
        loaded = bench.random_loaded_model("tiny-gpt-oss", jnp.float32, init=init)
        layers, top_k = loaded.params["layers"], loaded.config.extra["num_experts_per_tok"]
        sets = set()
        for i in range(layers["router"].shape[0]):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * layers["mlp_norm"][i]
            _, ids = jax.lax.top_k(h @ layers["router"][i] + layers["router_bias"][i], top_k)
            sets |= {(i, tuple(sorted(map(int, row)))) for row in ids}
        return sets, layers["router"].shape[0]

    dummy, num_layers = chosen_sets("vllm-dummy")
    assert len(dummy) == num_layers  # one set of experts a layer, whatever the token
    normal, _ = chosen_sets("normal")
    assert len(normal) > 4 * num_layers
    with pytest.raises(ValueError, match="init='xavier'"):
        bench.random_loaded_model("tiny-gpt-oss", jnp.float32, init="xavier")
