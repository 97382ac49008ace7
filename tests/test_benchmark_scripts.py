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


def test_fusion_ablation_leaves_out_only_what_it_names():
    # decode_latency.py --ablate times steps of this forward: with nothing left out it must be llama.forward's
    # computation (so an ablated row differs from its baseline only by the ops it names), and each name must
    # actually change the computation (else the row would time nothing left out).
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import jax.numpy as jnp
    import fusion_ablation
    from model_configs import random_loaded_model
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine
    from jlight.engine.sampling_params import SamplingParams

    loaded = random_loaded_model("tiny", jnp.float32)

    def prompt_logprobs(ablate):
        restore = fusion_ablation.install(ablate) if ablate is not None else (lambda: None)
        try:
            engine = LLMEngine(EngineConfig(model=None, max_num_seqs=2, max_model_len=64, num_pages=16, warmup=False),
                               loaded=loaded)
            engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               prompt_token_ids=[3, 14, 15, 92, 65, 35])
            outputs = []
            while engine.has_unfinished_requests():
                outputs.extend(engine.step())
            return [next(iter(d.values())) for d in outputs[-1].prompt_logprobs[1:]]  # {token: logprob} each
        finally:
            restore()

    reference = prompt_logprobs(None)
    assert prompt_logprobs(set()) == reference
    for name in fusion_ablation.ABLATIONS:
        ablated = prompt_logprobs({name})
        if name == "fold_norm":  # the same function while the norm weights are ones (the random model's)
            assert max(abs(a - b) for a, b in zip(ablated, reference)) < 1e-4
        else:
            assert max(abs(a - b) for a, b in zip(ablated, reference)) > 1e-3, name


def test_batch_decode_profile_fills_the_batch_and_times_its_decode_step(tmp_path):
    # the script's decode step must be one token per sequence, every sequence decoding; --sampler argmax
    # and --cub-sort are the two diagnostics its device runs compare against the engine as it is.
    for extra in ([], ["--sampler", "argmax", "--cub-sort", "--top-p", "0.9"]):
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_decode_profile.py"), "--model-config", "tiny",
                        "--batches", "3", "--context", "20", "--engine-steps", "4", "--out", str(tmp_path), *extra],
                       check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
        result = json.loads((tmp_path / "batch_decode_profile.json").read_text())
        row = result["rows"]["3"]
        assert row["step_ms"] > 0 and row["engine"]["tok_s"] > 0
        assert result["step_compiler_options"] == ({} if extra else {"xla_gpu_enable_cub_radix_sort": False})


def test_attention_large_pool_check_compares_with_the_reference():
    # the Triton kernel in interpret mode on CPU: bf16 rounding apart from the reference, every layer checked
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention_large_pool_check.py"), "--pages", "40",
                          "--layers", "2", "--batch", "3", "--context", "50", "--impls", "triton"],
                         check=True, cwd=ROOT, capture_output=True, text=True, timeout=600).stdout
    errors = [float(line.split("rel err ")[1].split()[0]) for line in out.splitlines() if line.startswith("layer")]
    assert len(errors) == 2 and all(0 < e < 1e-2 for e in errors), out


def test_step_trace_gives_each_step_the_wait_of_the_call_after_it(monkeypatch):
    # The engine runs one step ahead, so call k's wait is step k-1's device time; a step must get the
    # duration of the call after the one that scheduled it, and land in the group its plan says.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
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
