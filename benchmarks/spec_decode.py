"""Speculative decoding: what a verify step costs at batch 1, n-gram speculation end to end beside vLLM's, and
where it stops paying as the batch grows.

  python benchmarks/spec_decode.py --model-config llama3-8b --out DIR        (benchmarks/gpu.sh spec)
  python benchmarks/spec_decode.py --model-config tiny --contexts 32 --ks 0,1,3 --trials 2 --reps 3 \\
      --prompt-len 96 --max-tokens 24 --repeats 1 --max-model-len 256        # CPU smoke run

verify  One sequence of --contexts tokens decoding, its step verifying k drafts (k + 1 query tokens), for each k
        of --ks (k = 0: a plain decode step). The engine speculates with num_speculative_tokens = max(ks), its
        proposer replaced by one that hands out k drafts of fixed random ids every step (FixedDrafts), so each
        step has the shape and the sampler work of a real verify step; the step's inputs are the engine's own
        (runner.prepare of the scheduler's plan). Per k: the step run back to back on the device
        (decode_latency.back_to_back_ms, the median of --trials runs of --reps steps), the bucket it pads to,
        the ratio to k = 0, and one step launched from the host and waited for (packing, transfer, call, wait:
        what a speculating sequence pays, as it waits for each step before drafting the next). Derived: ms per
        token when a drafts of k are accepted, step(k) / (a + 1), and the speed-up step(0) * (a + 1) / step(k)
        over plain decode, the proposer's own cost excluded; the --accepted case (EAGLE-3's published ~3 accepted
        drafts a step on Llama-3-8B) is called out at each k that can reach it.
ngram   harness.ngram_prompt() (64 random ids repeated to --prompt-len), greedy, --max-tokens tokens, ignore_eos;
        ms/token = (t(N tokens) - t(1 token)) / (N - 1), median of --repeats (harness.bs1_ms_per_token, the
        peer's batch-1 method), speculation off, then on with {"method": "ngram", "num_speculative_tokens": K,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2} (K = --num-speculative-tokens), each engine after one
        untimed warm-up pair. With random weights the continuation is whatever the model makes, so each engine's
        acceptance (drafts, draft tokens, accepted tokens, mean acceptance length = 1 + accepted / drafts, from
        engine.stats() over the timed calls) stands beside its ms/token, with the engine's steps per generated
        token, its step() calls, model launches and serial launches per step, and its host ms per step by phase
        (LLMEngine.step_seconds: schedule with the proposer, prepare, launch, wait_and_process and the wait
        for the device within it). benchmarks/vllm_spec.py runs the same prompt and method through vLLM.
batch   Where speculation stops paying as the batch grows (SpeculativeConfig.disable_by_batch_size): for each B of
        --batches, B requests of harness.ngram_prompt() with B different patterns, greedy, decoded together;
        output tok/s = B (N - 1) / (t(N tokens each) - t(1 token each)), median of --repeats, speculation off and
        on (the ngram section's config, with disable_by_batch_size = the largest B, so it never pauses), each
        engine after one untimed call of every B; the on/off ratio and each engine's acceptance.

Prints one JSON line per measurement; --out DIR writes DIR/spec_decode.json (harness.write_result).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from decode_latency import _spy_on_steps, back_to_back_ms  # noqa: E402

from jlight.engine.proposers.base import Proposer  # noqa: E402
from jlight.engine.sampling_params import SamplingParams  # noqa: E402

EAGLE3_ACCEPTED = 3.0  # drafts accepted per verify step, about what EAGLE-3 reports for Llama-3-8B


def ngram_config(k: int) -> dict:
    """The speculative_config both engines run (vllm_spec.py passes the same dict to vLLM)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def emit(record: dict) -> None:
    print(json.dumps(record, default=float), flush=True)


# ------------------------------------------------------------------ verify step


class FixedDrafts(Proposer):
    """k drafts of fixed random ids for every sequence the scheduler lets speculate (fewer where the step's
    budget, the context or max_tokens leave less room); counts the sequences it was asked for."""

    def __init__(self, k: int, vocab_size: int, seed: int = 0):
        self.k, self.vocab_size, self.asked = k, vocab_size, 0
        self.rng = np.random.default_rng(seed)

    def drafts(self, seq, max_drafts: int) -> list[int]:
        self.asked += 1
        return self.rng.integers(0, self.vocab_size, min(self.k, max_drafts)).tolist()


def verify_step_inputs(engine, calls: list, prompt: list[int], k: int):
    """Admit one request of `prompt` and step the engine until it has launched the request's first step with
    k drafts; returns (request id, that step's StepInputs). The request stays running (its pages held)."""
    proposer = FixedDrafts(k, engine.model_config.vocab_size, seed=k)
    engine.scheduler.proposer = proposer
    rid = f"verify-{len(prompt)}-{k}"
    engine.add_request(rid, None, SamplingParams(temperature=0, max_tokens=k + 8, ignore_eos=True),
                       prompt_token_ids=prompt)
    while not proposer.asked:  # drafts are asked for in the step that verifies them
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the request finished before a step verified {k} drafts")
        engine.step()
    inp = calls[-1][0]
    row_tokens = np.diff(np.asarray(inp.md.query_start))  # [B]
    if row_tokens[0] != k + 1 or np.count_nonzero(row_tokens) != 1:
        raise RuntimeError(f"the step meant to verify {k} drafts has rows of {row_tokens.tolist()} tokens")
    return rid, inp


def synced_step_ms(runner, inp, reps: int) -> float:
    """Median ms of one step launched from its host inputs (runner.launch: packing, transfer, the call) and
    waited for: a speculating sequence's step, which the host waits for before it drafts the next one (so the
    serial variant, where the runner has one)."""
    jax.block_until_ready(runner.launch(inp, serial=True).tokens)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.launch(inp, serial=True).tokens)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def derived(step_ms: dict, accepted: float) -> dict:
    """Per k: ms/token and the speed-up over plain decode at each number of accepted drafts a = 0..k, and at
    `accepted` drafts where k reaches it."""
    base = step_ms[0]
    out = {}
    for k, ms in step_ms.items():
        row = dict(ratio_to_k0=ms / base,
                   ms_per_token_at_accepted={a: ms / (a + 1) for a in range(k + 1)},
                   speedup_at_accepted={a: base * (a + 1) / ms for a in range(k + 1)})
        if k >= accepted:
            row["speedup_at_eagle3_acceptance"] = base * (accepted + 1) / ms
        out[k] = row
    return out


def run_verify(loaded, a) -> dict:
    ks = sorted({int(k) for k in a.ks.split(",")} | {0})
    engine = harness.random_engine(a.model_config, loaded=loaded, max_model_len=a.max_model_len,
                                   max_num_seqs=a.max_num_seqs, num_pages=a.num_pages, warmup=False,
                                   speculative_config=ngram_config(max(max(ks), 1)))
    runner = engine.runner
    calls = _spy_on_steps(runner)
    vocab = engine.model_config.vocab_size
    result = {}
    for context in (int(c) for c in a.contexts.split(",")):
        prompt = [t % vocab for t in harness.bs1_prompt(context)]
        step_ms, rows = {}, {}
        for k in ks:
            rid, inp = verify_step_inputs(engine, calls, prompt, k)
            trials = [back_to_back_ms(runner, inp, a.reps) for _ in range(a.trials)]
            row = dict(prompt_tokens=context, kv_len_after_step=int(np.asarray(inp.md.context_lens)[0]), k=k, query_tokens=k + 1,
                       bucket=int(inp.tokens.shape[0]), step_ms=statistics.median(trials), trials_ms=trials,
                       synced_step_ms=synced_step_ms(runner, inp, a.reps))
            engine.abort_request(rid)
            engine.run_to_completion()
            step_ms[k] = row["step_ms"]
            rows[k] = row
        for k, extra in derived(step_ms, a.accepted).items():
            rows[k].update(extra)
            emit(dict(verify=rows[k]))
        reach = {k: r["speedup_at_eagle3_acceptance"] for k, r in rows.items() if "speedup_at_eagle3_acceptance" in r}
        summary = dict(context=context, plain_decode_ms=step_ms[0], accepted=a.accepted,
                       speedup_at_accepted_by_k=reach)
        if reach:
            best = max(reach, key=reach.get)
            summary.update(best_k=best, best_speedup=reach[best],
                           best_ms_per_token=step_ms[best] / (a.accepted + 1))
        emit(dict(verify_summary=summary))
        result[str(context)] = dict(rows={str(k): r for k, r in rows.items()}, summary=summary)
    del engine, runner
    gc.collect()
    return result


# ------------------------------------------------------------------ n-gram end to end


def spec_counts(engine) -> dict:
    s = engine.stats()
    return dict(drafts=s.spec_num_drafts, draft_tokens=s.spec_num_draft_tokens, accepted=s.spec_num_accepted_tokens,
                per_position=list(s.spec_accepted_per_position), steps=s.num_steps, ahead_rows=s.spec_num_ahead_rows,
                ahead_discarded=s.spec_num_ahead_discarded)


def acceptance(before: dict, after: dict) -> dict:
    """The counters' growth between two spec_counts, and the figures vLLM's metrics give."""
    d = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted", "steps", "ahead_rows",
                                                   "ahead_discarded")}
    d["accepted_per_position"] = [x - y for x, y in zip(after["per_position"], before["per_position"])]
    d["accepted_per_draft"] = d["accepted"] / d["drafts"] if d["drafts"] else 0.0
    d["mean_acceptance_length"] = 1 + d["accepted_per_draft"]
    d["draft_acceptance_rate"] = d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
    return d


def count_calls(engine) -> dict:
    """Counts of engine.step() calls, of the runner's model launches and of those launched serial (the serial
    variant where the runner has one) from now on (spies on both)."""
    calls = dict(step=0, launch=0, serial=0)
    step, launch = engine.step, engine.runner.launch

    def step_spy():
        calls["step"] += 1
        return step()

    def launch_spy(inp, guide_mask=None, serial=False):
        calls["launch"] += 1
        calls["serial"] += serial
        return launch(inp, guide_mask, serial)

    engine.step, engine.runner.launch = step_spy, launch_spy
    return calls


def run_ngram(loaded, a) -> dict:
    prompt = harness.ngram_prompt(a.prompt_len)
    result = {}
    for name, spec in (("off", None), ("on", ngram_config(a.num_speculative_tokens))):
        engine = harness.random_engine(a.model_config, loaded=loaded, max_model_len=a.max_model_len,
                                       max_num_seqs=a.max_num_seqs, num_pages=a.num_pages, warmup=False,
                                       speculative_config=spec)

        def generate(requests):
            return harness.engine_generate(engine, requests)

        t0 = time.perf_counter()
        harness.bs1_ms_per_token(generate, prompt, a.max_tokens, repeats=1)  # warm-up: every step shape compiled
        warmup_s = time.perf_counter() - t0
        calls = count_calls(engine)
        before, seconds, tokens_before = spec_counts(engine), dict(engine.step_seconds), engine.generation_tokens_total
        ms = harness.bs1_ms_per_token(generate, prompt, a.max_tokens, a.repeats)
        counts = acceptance(before, spec_counts(engine))
        steps, tokens = max(counts["steps"], 1), engine.generation_tokens_total - tokens_before
        loop = dict(steps_per_token=counts["steps"] / max(tokens, 1), step_calls_per_step=calls["step"] / steps,
                    launches_per_step=calls["launch"] / steps, serial_launches_per_step=calls["serial"] / steps,
                    host_ms_per_step={k: 1e3 * (v - seconds[k]) / steps for k, v in engine.step_seconds.items()})
        row = dict(spec=name, speculative_config=spec, draft_ahead=engine.scheduler.draft_ahead, prompt_tokens=len(prompt),
                   max_tokens=a.max_tokens, ms_per_token=ms, warmup_s=warmup_s, acceptance=counts, loop=loop)
        emit(dict(ngram=row))
        result[name] = row
        del engine, generate
        gc.collect()
    result["speedup"] = result["off"]["ms_per_token"] / result["on"]["ms_per_token"]
    emit(dict(ngram_speedup=result["speedup"]))
    return result


def run_batch(loaded, a) -> dict:
    batches = [int(b) for b in a.batches.split(",")]
    largest = max(batches)
    prompts = [harness.ngram_prompt(a.prompt_len, seed=3 + i) for i in range(largest)]
    num_pages = largest * -(-(a.prompt_len + a.max_tokens) // 16) + 8
    result = {}
    for name, spec in (("off", None), ("on", dict(ngram_config(a.num_speculative_tokens), disable_by_batch_size=largest))):
        engine = harness.random_engine(a.model_config, loaded=loaded, max_model_len=a.max_model_len,
                                       max_num_seqs=max(a.max_num_seqs, largest), num_pages=num_pages, warmup=False,
                                       speculative_config=spec)

        def timed(B, tokens):
            return harness.engine_generate(engine, [harness.Request(p, tokens) for p in prompts[:B]])[0]

        for B in batches:  # warm-up: every step shape of every batch compiled, the 1-token runs' too
            timed(B, a.max_tokens)
            timed(B, 1)
        rows = {}
        for B in batches:
            before = spec_counts(engine)
            seconds = statistics.median(timed(B, a.max_tokens) - timed(B, 1) for _ in range(a.repeats))
            rows[str(B)] = dict(output_tok_s=B * (a.max_tokens - 1) / seconds, acceptance=acceptance(before, spec_counts(engine)))
            emit(dict(batch=dict(spec=name, batch=B, **rows[str(B)])))
        result[name] = dict(speculative_config=spec, draft_ahead=engine.scheduler.draft_ahead, rows=rows)
        del engine
        gc.collect()
    result["speedup"] = {B: result["on"]["rows"][B]["output_tok_s"] / result["off"]["rows"][B]["output_tok_s"]
                         for B in result["off"]["rows"]}
    emit(dict(batch_speedup=result["speedup"]))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="llama3-8b", choices=harness.CONFIG_NAMES)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPUs, float32 on the CPU")
    ap.add_argument("--sections", default="verify,ngram", help="comma-separated, of: verify, ngram, batch")
    ap.add_argument("--contexts", default="128,2048", help="verify: prompt tokens before the verify step")
    ap.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="verify: drafts per step (0, plain decode, always)")
    ap.add_argument("--trials", type=int, default=3, help="verify: back-to-back runs per k (their median is reported)")
    ap.add_argument("--reps", type=int, default=20, help="verify: steps per back-to-back run, and synced steps")
    ap.add_argument("--accepted", type=float, default=EAGLE3_ACCEPTED, help="verify: drafts accepted a step to call out")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="ngram: K drafts a step")
    ap.add_argument("--prompt-len", type=int, default=1024, help="ngram: the repeated pattern's length")
    ap.add_argument("--max-tokens", type=int, default=256, help="ngram: N tokens a timed request generates")
    ap.add_argument("--repeats", type=int, default=3, help="ngram: the median of this many (t(N) - t(1)) pairs")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="batch: requests decoded together")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vllm_bench.py's value")
    ap.add_argument("--max-model-len", type=int, default=4096, help="vllm_bench.py's value")
    ap.add_argument("--num-pages", type=int, default=None, help="default: twice one max_model_len sequence's pages")
    ap.add_argument("--out", default=None, help="directory for spec_decode.json")
    a = ap.parse_args(argv)
    sections = a.sections.split(",")
    unknown = set(sections) - {"verify", "ngram", "batch"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from verify, ngram, batch")
    if a.num_pages is None:
        a.num_pages = 2 * -(-a.max_model_len // 16) + 8  # a small pool: engines of this process come and go

    dtype = a.dtype if a.dtype != "auto" else "float32" if jax.default_backend() == "cpu" else "bfloat16"
    loaded = harness.random_loaded_model(a.model_config, jnp.dtype(dtype), max_position_embeddings=a.max_model_len)
    result = dict(model=a.model_config, dtype=dtype, args=vars(a))
    if "verify" in sections:
        result["verify"] = run_verify(loaded, a)
        harness.write_result(a.out, "spec_decode", result)
    if "ngram" in sections:
        result["ngram"] = run_ngram(loaded, a)
        harness.write_result(a.out, "spec_decode", result)
    if "batch" in sections:
        result["batch"] = run_batch(loaded, a)
        harness.write_result(a.out, "spec_decode", result)
    return result


if __name__ == "__main__":
    main()
