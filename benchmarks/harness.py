"""The pieces every benchmark script shares: random-weight models by named shape, the vLLM peer's
request generators, the device's copy and matmul rates, engine runs timed the peer's way, and one
JSON result writer.

Models (benchmarks/model_configs.py holds the shapes):
  make_config(name, ...) -> ModelConfig; random_loaded_model(name, dtype, ...) -> LoadedModel (random
  weights, no tokenizer); random_engine(name, dtype=..., loaded=..., **EngineConfig fields) -> LLMEngine (several
  engines of one script share one LoadedModel through `loaded`);
  write_random_checkpoint(dir, shape) -> bytes written (a servable HF directory, make_random_checkpoint.py).

The peer's requests, copied call for call from ../shared/peer/vllm_bench.py and vllm_growth.py (a
jlight run that builds its requests with these measures the same work as the vLLM run):
  nano_workload()            nano-vllm's bench.py: random.seed(0), 256 prompts of randint(100, 1024) ids
                             randint(0, 10000), then max_tokens randint(100, 1024) each, temperature 0.6.
  fixed_workload(i, o, n)    random.seed(2), n prompts of i ids randint(0, 10000), o output tokens, temperature 0.6.
  bs1_prompt()               random.seed(1), 128 ids randint(0, 10000); bs1_ms_per_token() times it greedy:
                             (t(256 tokens) - t(1 token)) / 255, median of 3.
  growth_ttft_prompt(n)      [(7 * i + n) % 10000 for i in range(n)]: TTFT = wall time of 1 greedy token.
  ngram_prompt()             benchmarks/vllm_spec.py's repetitive prompt: random.seed(3), 64 ids randint(0, 10000), that
                             pattern repeated to 1024 ids (n-gram prompt lookup finds its drafts in it).
  growth_decode_prompts(n, b) row j = [(11 * i + n + j) % 10000 for i in range(n)]; growth_decode_ms_per_step()
                             = (t(66 tokens) - t(2 tokens)) / 64, greedy; (n, b) with b * n > 300,000 skipped.
  GROWTH_ENGINE              the growth run's engine settings (32k context, 64 sequences, prefix caching off:
                             each batch runs twice, and a cached prompt would skip its prefill).
  GROWTH_LENGTHS (1024 ... 32000), growth_cases() (the (length, batch) pairs in the peer's order),
  growth_ttft_ms(generate, n), GROWTH_WARMUP (the peer's untimed first request).
Every request ignores EOS (vLLM's ignore_eos=True); jlight's random models have no tokenizer to detokenize with.
A request is Request(prompt_token_ids, max_tokens, temperature); engine_generate(engine, requests) -> (wall seconds,
output tokens) runs a list of them as the peer times one `llm.generate` call, and is the `generate` the timing
helpers above take (`lambda requests: engine_generate(engine, requests)`).

Rates of the device (median_seconds(fn, *args): host clock around block_until_ready, median of `reps` calls
after a compiling call):
  copy_bytes_per_s()   a plain device-to-device copy of a 2 GiB buffer (jnp.copy under jit: XLA copies the
                       parameter into a fresh output buffer), counting the bytes read plus the bytes written.
  matmul_flops_per_s() an n x n x n bf16 matmul, 2 n^3 FLOPs per call.
  host_copy_bytes_per_s() device -> host and host -> device copies of a 1 GiB buffer by jax.device_put between
                       memory kinds (pinned_host where the device has it), the path of the host KV tier's copies.
  weight_bytes(params) the bytes a decode step reads: every weight but the embedding table.
  active_weight_bytes(params, config) the bytes one token's decode step reads in a MoE model: weight_bytes with
                       the routed experts' weights (params named experts_*) counted at top_k / num_experts.

Results: result_header() -> dict(date, device, backend, jax, python, host, command, git_commit);
write_result(out_dir, name, result) writes OUT_DIR/NAME.json with that header first.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_configs  # noqa: E402
from model_configs import CONFIG_NAMES, INITS, MOE_CONFIGS, NAMED_CONFIGS, make_config, decode_bytes, routed_fraction  # noqa: E402,F401

# ------------------------------------------------------------------ models


def random_loaded_model(name: str, dtype, seed: int = 0, max_position_embeddings: int = 8192, mxfp4: bool = False,
                        init: str = "normal"):
    """model_configs.random_loaded_model (a LoadedModel of random weights, no tokenizer), with JAX's persistent
    compilation cache switched on first, in the directory an engine would use (EngineConfig.compilation_cache_dir),
    so the jitted random init compiles once per machine and shape, as the engine's steps do."""
    from jlight.engine.engine_config import EngineConfig

    cache_dir = EngineConfig().compilation_cache_dir
    if cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return model_configs.random_loaded_model(name, dtype, seed=seed, max_position_embeddings=max_position_embeddings,
                                             mxfp4=mxfp4, init=init)


def random_engine(name: str, dtype: str = "bfloat16", *, max_model_len: int = 4096, seed: int = 0, loaded=None,
                  **engine_fields):
    """An LLMEngine over random weights of a named shape (no tokenizer: requests give prompt_token_ids).
    loaded: a LoadedModel from random_loaded_model to build on (name, dtype and seed then unused), else one is made.
    engine_fields go to EngineConfig as they are (max_num_seqs, quantization, attention_impl, mesh ...)."""
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    made_here = loaded is None  # then the engine is given the weights: one copy at the peak, not two
    if made_here:
        loaded = random_loaded_model(name, jnp.dtype(dtype), seed=seed, max_position_embeddings=max_model_len)
    return LLMEngine(EngineConfig(model=None, max_model_len=max_model_len, **engine_fields), loaded=loaded,
                     give_weights=made_here)


def write_random_checkpoint(directory: str, shape: str = "small", **kwargs) -> int:
    """A servable random Llama checkpoint (`jlight serve DIR`): make_random_checkpoint.write_checkpoint."""
    import make_random_checkpoint

    return make_random_checkpoint.write_checkpoint(directory, dict(make_random_checkpoint.SHAPES[shape]), **kwargs)


# ------------------------------------------------------------------ the peer's requests


@dataclasses.dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0


NANO_TEMPERATURE = 0.6


def nano_workload(num_requests: int = 256, input_len: tuple[int, int] = (100, 1024),
                  output_len: tuple[int, int] = (100, 1024), seed: int = 0) -> list[Request]:
    """vllm_bench.py's `nano` requests (its defaults are these arguments' defaults): every prompt first,
    then every max_tokens, from one random.Random(seed), in the peer's order of calls."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return [Request(p, m, NANO_TEMPERATURE) for p, m in zip(prompts, max_tokens)]


def fixed_workload(input_len: int, output_len: int, num_requests: int, seed: int = 2) -> list[Request]:
    """vllm_bench.py's `--fixed IN OUT N` requests (the peer's README reports 1000 1000 1000)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(input_len)] for _ in range(num_requests)]
    return [Request(p, output_len, NANO_TEMPERATURE) for p in prompts]


def bs1_prompt(length: int = 128, seed: int = 1) -> list[int]:
    """vllm_bench.py's `bs1` prompt."""
    rng = random.Random(seed)
    return [rng.randint(0, 10000) for _ in range(length)]


def bs1_ms_per_token(generate, prompt: list[int], tokens: int = 256, repeats: int = 3) -> float:
    """vllm_bench.py's batch-1 decode: (t(`tokens` greedy tokens) - t(1 token)) / (tokens - 1) in ms,
    the median of `repeats`. generate(requests) -> (wall seconds, output tokens), e.g. engine_generate's partial."""
    runs = []
    for _ in range(repeats):
        t1, _ = generate([Request(prompt, 1)])
        tn, _ = generate([Request(prompt, tokens)])
        runs.append((tn - t1) / (tokens - 1) * 1e3)
    return statistics.median(runs)


def ngram_prompt(length: int = 1024, pattern: int = 64, seed: int = 3) -> list[int]:
    """vllm_spec.py's prompt for n-gram speculation: `pattern` ids randint(0, 10000) from random.seed(seed),
    repeated (and cut) to `length` ids."""
    rng = random.Random(seed)
    unit = [rng.randint(0, 10000) for _ in range(pattern)]
    return (unit * -(-length // pattern))[:length]


GROWTH_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32000)
GROWTH_BATCHES = {1: "decode_b1", 16: "decode_b16"}
GROWTH_MAX_BATCH_TOKENS = 300000  # a (length, batch) with batch x length above this is skipped
GROWTH_DECODE_TOKENS = (2, 66)  # ms per step = (t(66) - t(2)) / 64
GROWTH_ENGINE = dict(max_model_len=32768, max_num_seqs=64, enable_prefix_caching=False)
GROWTH_WARMUP = Request([5] * 64, 4)  # vllm_growth.py's first call, untimed


def growth_ttft_prompt(n: int) -> list[int]:
    """vllm_growth.py's TTFT prompt of n tokens."""
    return [(7 * i + n) % 10000 for i in range(n)]


def growth_decode_prompts(n: int, batch: int) -> list[list[int]]:
    """vllm_growth.py's decode batch: `batch` prompts of n tokens, row j = [(11 * i + n + j) % 10000]."""
    return [[(11 * i + n + j) % 10000 for i in range(n)] for j in range(batch)]


def growth_cases(lengths=GROWTH_LENGTHS, batches=tuple(GROWTH_BATCHES)) -> list[tuple[int, int]]:
    """The (length, batch) decode cases vllm_growth.py runs, in its order (lengths outer)."""
    return [(n, b) for n in lengths for b in batches if b * n <= GROWTH_MAX_BATCH_TOKENS]


def growth_ttft_ms(generate, n: int) -> float:
    """Wall time of one greedy token after the n-token growth prompt (prefill + the first step), ms."""
    seconds, _ = generate([Request(growth_ttft_prompt(n), 1)])
    return seconds * 1e3


def growth_decode_ms_per_step(generate, n: int, batch: int) -> float:
    """vllm_growth.py's decode cost at context n: (t(66 tokens) - t(2 tokens)) / 64 for the batch, ms."""
    short, long = GROWTH_DECODE_TOKENS
    prompts = growth_decode_prompts(n, batch)
    ta, _ = generate([Request(p, short) for p in prompts])
    tb, _ = generate([Request(p, long) for p in prompts])
    return (tb - ta) / (long - short) * 1e3


# ------------------------------------------------------------------ engine runs

_request_ids = iter(range(1 << 62))


def engine_generate(engine, requests: list[Request], output_kind: str = "final_only") -> tuple[float, int]:
    """Add every request, step the engine until all have finished: (wall seconds from the first add to
    the last output, output tokens), as the peer times one `llm.generate` call, whose requests ask for their
    final output only (vLLM's FINAL_ONLY: no output for a request before it finishes; `output_kind` another
    SamplingParams.output_kind, to see what building outputs costs the host). A model whose vocabulary
    is smaller than the peer's ids (up to 10,000: the tiny CPU shapes) gets each id modulo its vocabulary."""
    from jlight.engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    prompts = [r.prompt_token_ids if vocab > 10000 else [t % vocab for t in r.prompt_token_ids] for r in requests]
    t0 = time.perf_counter()
    for r, prompt in zip(requests, prompts):
        engine.add_request(f"bench-{next(_request_ids)}", None,
                           SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, ignore_eos=True,
                                          output_kind=output_kind),
                           prompt_token_ids=prompt)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids_delta)  # every kind carries the new tokens there
    return time.perf_counter() - t0, tokens


def spy_on_step_calls(engine) -> list[tuple[float, dict, dict]]:
    """Each engine.step() call from now on (appended as they end): its host seconds, the seconds of each of
    the engine's step phases (LLMEngine.step_seconds) within it, and the pages the host tier copied in it
    (to the host, back to the device; empty without a tier)."""
    calls, step = [], engine.step
    tier = engine.block_manager.host_tier
    pages = lambda: {} if tier is None else {"pages_out": tier.offloaded_pages, "pages_back": tier.restored_pages}

    def timed():
        phases0, pages0 = dict(engine.step_seconds), pages()
        t0 = time.perf_counter()
        out = step()
        calls.append((time.perf_counter() - t0, {k: v - phases0[k] for k, v in engine.step_seconds.items()},
                      {k: v - pages0[k] for k, v in pages().items()}))
        return out

    engine.step = timed
    return calls


def spy_on_launches(engine) -> list[tuple[bool, bool, float, tuple]]:
    """Each runner.launch() from now on: whether the step launched before it (the one the device runs meanwhile)
    was done when the launch began and when it returned, the launch's seconds, and the step's variant (its
    tokens and page-table width: which compiled step it runs). A launch that waits on the device shows as
    (False, True) however long the device takes; a host that is slow only in its own work shows (True, True)
    once the device has caught up. Launch i is engine.step() call i counted from the same moment (every call
    launches but the last, which only reads back), so profile_step_calls can take a window around one.
    Undone by stop_spying."""
    records, launch, last = [], engine.runner.launch, [None]

    def watched(inp, *args, **kwargs):
        prev = last[0]
        before = prev is None or prev.tokens.is_ready()
        t0 = time.perf_counter()
        out = launch(inp, *args, **kwargs)
        seconds = time.perf_counter() - t0
        variant = (len(inp.tokens), inp.md.page_table.shape[1], bool(kwargs.get("serial")))
        records.append((before, prev is None or prev.tokens.is_ready(), seconds, variant))
        last[0] = out
        return out

    engine.runner.launch = watched
    return records


def launch_waits(records: list[tuple[bool, bool, float, tuple]], slow_factor: float = 5.0, listed: int = 12) -> dict:
    """spy_on_launches' records summed up: the share of launches that began with the step before them still
    running, the share of those that returned with it done, and the launches' median ms in each case; and the
    slow launches (over slow_factor times the median): how many, their ms in all, how many ran another
    compiled step than the launch before them, and the first `listed` of them as [index, the variant before,
    its variant, ms] (variant: [tokens, table width, serial])."""
    running = [r for r in records if not r[0]]
    ms = lambda rs: round(1e3 * statistics.median(r[2] for r in rs), 3) if rs else None
    out = {"launches": len(records), "began_with_device_busy": round(len(running) / max(len(records), 1), 3),
           "of_those_returned_with_it_done": round(sum(r[1] for r in running) / max(len(running), 1), 3),
           "median_ms_device_busy_at_start": ms(running), "median_ms_device_idle_at_start": ms([r for r in records if r[0]])}
    if records:
        bound = slow_factor * statistics.median(r[2] for r in records)
        slow = [(i, records[i - 1][3] if i else None, r[3], r[2]) for i, r in enumerate(records) if r[2] > bound]
        out["slow"] = {"over_ms": round(1e3 * bound, 3), "count": len(slow), "total_ms": round(1e3 * sum(s[3] for s in slow), 1),
                       "after_another_variant": sum(s[1] is not None and s[1] != s[2] for s in slow),
                       "first": [[i, list(a) if a else None, list(b), round(1e3 * t, 2)] for i, a, b, t in slow[:listed]]}
    return out


def stop_spying(engine) -> None:
    """engine.step() and runner.launch() as they were before spy_on_step_calls / spy_on_launches."""
    engine.__dict__.pop("step", None)
    engine.runner.__dict__.pop("launch", None)


def profile_step_calls(engine, first: int, count: int, log_dir: str):
    """A jax.profiler trace (XPlane, and Perfetto's trace.json.gz) of engine.step() calls first .. first + count - 1,
    counted from now, into log_dir: the host's threads (dispatch, the runtime's waits) and, on a GPU, the device's
    kernels and copies. Returns the function that ends the trace where the run ended inside the window; the
    wrapper goes with stop_spying."""
    step, calls, tracing = engine.step, itertools.count(), [False]

    def stop() -> None:
        if tracing[0]:
            jax.profiler.stop_trace()
            tracing[0] = False

    def profiled():
        i = next(calls)
        if i == first:
            jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
            tracing[0] = True
        try:
            return step()
        finally:
            if i == first + count - 1:
                stop()

    engine.step = profiled
    return stop


def trace_hotspots(log_dir: str, top: int = 25) -> list[dict]:
    """The events of the newest Perfetto trace under log_dir (profile_step_calls), summed by name: each name's
    self time (its events' durations less those of the events nested in them on the same thread: a wait shows
    where it waits, not in every frame above it), its total time and count, the largest self time first."""
    import glob
    import gzip

    paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    if not paths:
        return []
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    events.sort(key=lambda e: (e.get("pid"), e.get("tid"), e["ts"], -e.get("dur", 0)))
    self_us = [e.get("dur", 0) for e in events]
    stack: list[int] = []  # the enclosing events of the current one, on its thread
    for i, e in enumerate(events):
        while stack and (events[stack[-1]].get("pid"), events[stack[-1]].get("tid")) != (e.get("pid"), e.get("tid")):
            stack.pop()
        while stack and events[stack[-1]]["ts"] + events[stack[-1]].get("dur", 0) <= e["ts"]:
            stack.pop()
        if stack:
            self_us[stack[-1]] -= e.get("dur", 0)
        stack.append(i)
    totals: dict[str, list] = {}
    for e, own in zip(events, self_us):
        entry = totals.setdefault(e["name"], [0.0, 0.0, 0])
        entry[0] += max(own, 0) / 1e3
        entry[1] += e.get("dur", 0) / 1e3
        entry[2] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(name=name[:160], self_ms=round(own, 3), ms=round(ms, 3), count=n) for name, (own, ms, n) in rows]


def profile_summary(log_dir: str, first: int, count: int) -> dict:
    """What profile_step_calls traced, for a result: the window and trace_hotspots' rows."""
    return dict(first=first, count=count, dir=log_dir, hotspots=trace_hotspots(log_dir))


def format_hotspots(profile: dict, top: int = 12) -> str:
    """profile_summary's hotspots on one line, the largest self time first."""
    return f"events by self time ({profile['dir']}): " + "; ".join(
        f"{h['name'][:70]} {h['self_ms']:.1f} ms ({h['ms']:.1f} with what it encloses) x{h['count']}"
        for h in profile["hotspots"][:top])


def steps_compiled_by_jit(engine) -> int:
    """Steps the runner compiled through jit, outside its warm-up's executables (a layout warm-up did not make):
    a run that adds some paid for their compiles in its launches."""
    runner = engine.runner
    return sum(f._cache_size() for f in (runner._step, runner._serial_step) if f is not None)


# ------------------------------------------------------------------ rates of the device


def median_seconds(fn, *args, reps: int = 10) -> float:
    """Median wall time of fn(*args) (waited for), after one call that compiles."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bytes_per_s(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate of a plain copy: 2 x nbytes (read + written) / its median time."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)  # [nbytes / 4]
    return 2 * x.nbytes / median_seconds(jax.jit(jnp.copy), x, reps=reps)


def host_copy_bytes_per_s(nbytes: int = 1 << 30, reps: int = 10) -> dict:
    """{"memory_kind", "device_to_host", "host_to_device"}: bytes/s of jax.device_put between the device's memory
    and host memory (pinned_host where the device has it, else unpinned_host), median of `reps` copies."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)  # [nbytes / 4]
    kinds = {m.kind for m in next(iter(x.devices())).addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
    on_host = jax.device_put(x, x.sharding.with_memory_kind(kind))
    return dict(memory_kind=kind,
                device_to_host=x.nbytes / median_seconds(lambda: jax.device_put(x, on_host.sharding), reps=reps),
                host_to_device=x.nbytes / median_seconds(lambda: jax.device_put(on_host, x.sharding), reps=reps))


def matmul_flops_per_s(n: int = 8192, reps: int = 10) -> float:
    """bf16 matmul rate: 2 n^3 / the median time of an n x n x n product."""
    a = jnp.ones((n, n), jnp.bfloat16)  # [n, n]
    return 2.0 * n ** 3 / median_seconds(jax.jit(lambda a: a @ a), a, reps=reps)


def weight_bytes(params) -> int:
    """Bytes a decode step must read: every weight but the embedding table (a step gathers only its rows)."""
    return decode_bytes(_leaf_bytes(params))


def _leaf_bytes(params) -> list[tuple[str, int]]:
    return [(jax.tree_util.keystr(path), x.nbytes) for path, x in jax.tree_util.tree_leaves_with_path(params)]


def active_weight_bytes(params, config) -> int:
    """Bytes a batch-1 decode step must read: weight_bytes, the routed experts' weights (every param named
    experts_*: their matrices and gpt-oss's down biases) counted at top_k / num_experts, since one token runs
    top_k experts. Equal to weight_bytes for a dense model."""
    return decode_bytes(_leaf_bytes(params), routed_fraction(config))


# ------------------------------------------------------------------ results


def git_commit() -> str:
    """The checkout's commit (with "+dirty" when tracked files differ from it); $JLIGHT_GIT_COMMIT where the
    tree came without its .git (the GPU machine gets a copy of the working tree); "unknown" otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("JLIGHT_GIT_COMMIT", "unknown")


def result_header(argv: list[str] | None = None) -> dict:
    """What every result file starts with: when, on what, by which command, from which commit."""
    device = jax.devices()[0]
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=f"{jax.device_count()} x {device.device_kind}", backend=jax.default_backend(),
                jax=jax.__version__, python=platform.python_version(), host=platform.node(),
                command=shlex.join([os.path.relpath(sys.argv[0]) if sys.argv else "python"] + list(
                    sys.argv[1:] if argv is None else argv)),
                git_commit=git_commit())


def write_result(out_dir: str | None, name: str, result: dict) -> str | None:
    """OUT_DIR/NAME.json: result_header() then `result` (its own keys win). None when out_dir is None."""
    if out_dir is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({**result_header(), **result}, f, indent=1, default=str)
    return path
