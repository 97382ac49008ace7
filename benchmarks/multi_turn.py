"""Multi-turn chat with and without the host-memory KV tier (host_tier.py): TTFT, throughput, the tier's hits
and copies, and the device <-> host copy rate against PCIe's.

The workload (deterministic; random.Random(--seed) draws every id, randint(0, 9999), taken modulo the vocabulary
on shapes with 10,000 ids or fewer, as harness.engine_generate does):
  - one system prompt of S ids (--system-len), shared by every conversation, drawn first;
  - C conversations (--conversations) of T turns (--turns); then, conversation by conversation and turn by turn,
    a user message of U ids (--user-len);
  - turn t's prompt = the system prompt + every earlier user message and reply of its conversation, in order
    + its own user message; it generates R tokens (--reply-len; EOS ignored; greedy, or --temperature with
    the request seed Random(f"{seed}-{c}-{t}").randrange(2**31)), and those R tokens are the reply the next
    turn's prompt carries;
  - at most --concurrency turns are in the engine at once (max_num_seqs is the same); conversations wait in one
    first-in first-out queue, all C in order at the start, and a conversation whose turn finished joins its back
    with its next turn. Each conversation's turns thus run strictly one after the other, and between two turns
    of one conversation the C - 1 others each run one turn (round-robin: a user's think time).
TTFT is the engine's first-token time minus its arrival time (the turn's submission; the queue before it not
counted); output tok/s is every reply token over the wall time of the whole run.

The device pool is small on purpose: by default (--num-pages) it holds the running turns at the last turn
(concurrency x pages of S + T x (U + R) tokens, + 25%, + the scratch page), and no more: round-robin over C conversations touches
about (C - 1) x a whole context of pages between two turns of one conversation, far more than that pool, so
under the pool's LRU a conversation's history is gone from the device by its next turn (only the shared system
prompt stays): the host tier (sized by default to hold every conversation's history, + 25%) is where it can
come back from; with the tier off it is computed again.

The H200 defaults (llama3-8b, bf16): C=64, T=4, S=1024, U=256, R=128, concurrency 16, 16-token pages. The
history of all conversations is S + C x T x (U + R) = 99,328 tokens (6,208 pages of 2 MiB, 12 GiB); the
default pool is 3,200 pages (6.25 GiB, ~half the history: the running turns' floor; a smaller share would
need more conversations and a longer run, and changes nothing measured, the device keeping no conversation's
history between its turns either way). The run is 256 turns: 32,768 reply tokens in ~2,048 decode steps of
16 rows, and ~213k prompt tokens computed with the tier off (everything but the system prompt) against ~68k
with it on (the user messages); the three runs, each engine's start (~40-60 s each) included, fit in ~4 minutes.

Runs: --tier off (kv_offloading_size None), on (the tier, its pages travelling inside its gather and scatter
programs: kv_offloading_copies="in_program", the default), on-device-put (the tier with
kv_offloading_copies="device_put": a jax.device_put array a page each way), device (no tier, and a device pool that
holds every history: the tier's ideal, and its exactness reference), or all (the default: one subprocess each, so an engine's device
memory is gone before the next starts; --in-process runs them one after the other here, for CPU smoke runs).
Reported per run: TTFT median / P99 / by turn, output tok/s, prefix-cache hit tokens by tier (device / host),
the tier's pages copied each way (to host, back to the device) and the seconds those bytes take at the measured
copy rate, the engine's host ms a step by phase (the tier's sync apart) and its
slowest step() calls; with all runs, whether their replies agree token for token: off against on (greedy
runs compute the same prefixes two ways, so on bf16 a near-tie can differ: the work, the lengths, is the same),
and on against device, which must agree (both reuse the K/V first computed).
With the tier on, harness.host_copy_bytes_per_s() once, beside PCIe Gen5 x16's 64 GB/s per direction.

  python benchmarks/multi_turn.py --out DIR                       (the H200 run: off, on, device)
  python benchmarks/multi_turn.py --smoke --in-process            (a tiny CPU run: seconds)
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

PCIE_GEN5_X16_BYTES_PER_S = 64e9  # per direction
# "on-device-put": the tier with its pages copied by jax.device_put, not inside its programs (EngineConfig.kv_offloading_copies)
TIERS = ("off", "on", "on-device-put", "device")
# A tiny CPU run (--smoke): the tiny shape, a pool of 2 running turns, the tier exercised in seconds.
SMOKE = dict(model_config="tiny", dtype="float32", conversations=8, turns=3, system_len=16, user_len=8, reply_len=6,
             concurrency=2, page_size=8, max_num_batched_tokens=64, min_token_bucket=64)


# ------------------------------------------------------------------ the workload


def make_workload(conversations: int, turns: int, system_len: int, user_len: int, vocab: int, seed: int):
    """(system prompt ids, user[c][t] ids) of the module docstring's workload."""
    rng = random.Random(seed)
    fit = (lambda t: t) if vocab > 10000 else (lambda t: t % vocab)
    draw = lambda n: [fit(rng.randint(0, 9999)) for _ in range(n)]  # noqa: E731
    system = draw(system_len)
    return system, [[draw(user_len) for _ in range(turns)] for _ in range(conversations)]


def sizes(a) -> dict:
    """The workload's token and page counts, and the device pool and host tier it runs with."""
    pages = lambda n: -(-n // a.page_size)  # noqa: E731
    context = a.system_len + a.turns * (a.user_len + a.reply_len)  # the last turn's prompt + reply
    history = a.system_len + a.conversations * a.turns * (a.user_len + a.reply_len)
    running = a.concurrency * pages(context)
    num_pages = a.num_pages or running * 5 // 4 + 1
    cfg = harness.make_config(a.model_config)
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * a.page_size * np.dtype(a.dtype).itemsize
    tier_gib = a.kv_offloading_size or pages(history) * page_bytes * 5 / 4 / 2**30
    return dict(max_model_len=pages(context) * a.page_size, history_tokens=history, history_pages=pages(history),
                running_pages=running, num_pages=num_pages, device_run_pages=pages(history) + running + 1,
                pool_share_of_history=(num_pages - 1) / pages(history),
                page_bytes=page_bytes, kv_offloading_size_gib=tier_gib)


# ------------------------------------------------------------------ one run


def run_conversations(engine, system: list[int], user: list[list[list[int]]], a) -> list[dict]:
    """The workload through the engine: one record per turn (conversation, turn, prompt tokens, cached tokens,
    TTFT, reply), in the order they finished."""
    from jlight.engine.sampling_params import SamplingParams

    turns = len(user[0])
    history = [list(system) for _ in user]
    next_turn = [0] * len(user)
    ready = collections.deque(range(len(user)))
    in_flight: dict[str, tuple[int, int, list[int]]] = {}
    submitted, first_step = {}, {}  # request id -> the engine's step count at its submission, at its first token
    records = []
    while ready or in_flight:
        while ready and len(in_flight) < a.concurrency:
            c = ready.popleft()
            t = next_turn[c]
            prompt = history[c] + user[c][t]
            seed = random.Random(f"{a.seed}-{c}-{t}").randrange(2**31)
            params = SamplingParams(temperature=a.temperature, max_tokens=a.reply_len, ignore_eos=True, seed=seed)
            rid = engine.add_request(f"conv{c}-turn{t}", None, params, prompt_token_ids=prompt)
            in_flight[rid] = (c, t, prompt)
            submitted[rid] = engine.num_steps
        for out in engine.step():
            if out.request_id not in first_step and out.outputs[0].token_ids:
                first_step[out.request_id] = engine.num_steps
            if not out.finished:
                continue
            c, t, prompt = in_flight.pop(out.request_id)
            reply = list(out.outputs[0].token_ids)
            records.append(dict(conversation=c, turn=t, prompt_tokens=len(prompt), cached_tokens=out.num_cached_tokens,
                                ttft_s=out.first_token_time - out.arrival_time, reply=reply,
                                steps_to_first_token=first_step.pop(out.request_id) - submitted.pop(out.request_id)))
            history[c] = prompt + reply
            next_turn[c] += 1
            if next_turn[c] < turns:
                ready.append(c)
    return records


def reply_digest(reply: list[int]) -> str:
    return hashlib.sha1(json.dumps(reply).encode()).hexdigest()[:12]


def run_tier(a, tier: str) -> dict:
    """One engine (host tier on or off, or "device": no tier and a pool that holds every history) through the
    workload: its result dict (each reply's digest under "reply_digests": {"c-t": digest})."""
    size = sizes(a)
    t0 = time.perf_counter()
    engine = harness.random_engine(
        a.model_config, a.dtype, max_model_len=size["max_model_len"], seed=a.seed,
        max_num_seqs=a.concurrency, page_size=a.page_size,
        num_pages=size["device_run_pages" if tier == "device" else "num_pages"],
        max_num_batched_tokens=a.max_num_batched_tokens, min_token_bucket=a.min_token_bucket,
        kv_offloading_size=size["kv_offloading_size_gib"] if tier.startswith("on") else None,
        kv_offloading_copies="device_put" if tier == "on-device-put" else "in_program")
    init_s = time.perf_counter() - t0
    print(f"[tier {tier}] engine ready in {init_s:.1f} s ({engine.block_manager.num_pages} device pages"
          + (f", host tier of {engine.block_manager.host_tier.capacity} pages" if tier.startswith("on") else "") + ")",
          flush=True)
    harness.engine_generate(engine, [harness.Request([1] * 8, 4)])  # the first call's own costs out of the run
    system, user = make_workload(a.conversations, a.turns, a.system_len, a.user_len, engine.model_config.vocab_size, a.seed)
    before = engine.stats()
    tier_obj = engine.block_manager.host_tier
    restored0 = tier_obj.restored_pages if tier_obj is not None else 0
    seconds0 = dict(engine.step_seconds)
    profile_dir = os.path.join(a.out or ".", f"profile_{tier}") if a.profile_steps else None
    stop_profile = harness.profile_step_calls(engine, *a.profile_steps, profile_dir) if a.profile_steps else None
    step_calls = harness.spy_on_step_calls(engine)
    t0 = time.perf_counter()
    try:
        records = run_conversations(engine, system, user, a)
    finally:
        if stop_profile is not None:
            stop_profile()
    wall = time.perf_counter() - t0
    slowest = sorted(range(len(step_calls)), key=lambda i: -step_calls[i][0])[:8]  # the calls' indices, slowest first
    after = engine.stats()
    delta = lambda name: getattr(after, name) - getattr(before, name)  # noqa: E731

    ttft_ms = [r["ttft_s"] * 1e3 for r in records]
    output_tokens = sum(len(r["reply"]) for r in records)
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    result = dict(
        tier=tier, init_s=init_s, wall_s=wall, turns=len(records), output_tokens=output_tokens,
        output_tok_s=output_tokens / wall, prompt_tokens=prompt_tokens,
        cached_prompt_tokens=sum(r["cached_tokens"] for r in records),
        ttft_ms=dict(median=statistics.median(ttft_ms), p99=float(np.percentile(ttft_ms, 99)), mean=statistics.fmean(ttft_ms)),
        ttft_ms_median_by_turn=[statistics.median(r["ttft_s"] * 1e3 for r in records if r["turn"] == t) for t in range(a.turns)],
        # steps from a turn's submission to its first token (its prompt's chunks, and any step it waited), by turn
        steps_to_first_token_median_by_turn=[statistics.median(r["steps_to_first_token"] for r in records if r["turn"] == t)
                                             for t in range(a.turns)],
        computed_prompt_tokens_median_by_turn=[statistics.median(r["prompt_tokens"] - r["cached_tokens"] for r in records
                                                                 if r["turn"] == t) for t in range(a.turns)],
        device_cache_hit_tokens=delta("device_cache_hit_tokens"), host_cache_hit_tokens=delta("host_cache_hit_tokens"),
        preemptions=delta("num_preemptions"), steps=delta("num_steps"),
        host_ms_per_step={k: 1e3 * (v - seconds0[k]) / max(delta("num_steps"), 1) for k, v in engine.step_seconds.items()},
        slowest_step_calls_ms=[1e3 * step_calls[i][0] for i in slowest],
        # which calls they were (--profile-steps takes a window of them: the run is the same each time)
        slowest_step_calls_index=slowest,
        # where the slowest calls' time went, phase by phase (the tier's sync is inside schedule, and apart in tier)
        slowest_step_calls_phases_ms=[{k: round(1e3 * v, 2) for k, v in step_calls[i][1].items()} for i in slowest],
        # and the pages the tier copied in each (a launch that waits behind the tier's copies grows with them)
        slowest_step_calls_pages=[step_calls[i][2] for i in slowest],
        step_calls_over_100ms=sum(s > 0.1 for s, _, _ in step_calls),
        reply_digests={f"{r['conversation']}-{r['turn']}": reply_digest(r["reply"]) for r in records})
    if tier_obj is not None:
        to_host, to_device = delta("host_cache_offloaded_pages"), tier_obj.restored_pages - restored0
        result["host_tier"] = dict(reserved_gib=tier_obj.reserved_bytes / 2**30, reserve_s=tier_obj.reserve_seconds,
                                   pages_to_host=to_host, pages_to_device=to_device,
                                   dropped_pages=delta("host_cache_dropped_pages"), pages_total=after.host_cache_pages_total,
                                   bytes_to_host=to_host * size["page_bytes"], bytes_to_device=to_device * size["page_bytes"])
        result["host_copy_bytes_per_s"] = copy_rates()
        rates = result["host_copy_bytes_per_s"]
        result["host_tier"]["copy_s_at_measured_rate"] = (result["host_tier"]["bytes_to_host"] / rates["device_to_host"]
                                                          + result["host_tier"]["bytes_to_device"] / rates["host_to_device"])
    if profile_dir is not None:
        result["profile"] = harness.profile_summary(profile_dir, *a.profile_steps)
    print_run(result, a.page_size)
    return result


def copy_rates() -> dict:
    """harness.host_copy_bytes_per_s: 1 GiB copies on an accelerator, 1 MiB on the CPU (a smoke run)."""
    import jax
    return harness.host_copy_bytes_per_s() if jax.default_backend() != "cpu" else harness.host_copy_bytes_per_s(1 << 20, 2)


def print_run(r: dict, page_size: int) -> None:
    t = r["ttft_ms"]
    print(f"[tier {r['tier']}] {r['turns']} turns in {r['wall_s']:.1f} s: {r['output_tok_s']:.0f} output tok/s; TTFT median "
          f"{t['median']:.1f} ms, P99 {t['p99']:.1f} ms; by turn " + ", ".join(f"{x:.1f}" for x in r["ttft_ms_median_by_turn"])
          + " ms; steps to the first token by turn " + ", ".join(f"{x:g}" for x in r["steps_to_first_token_median_by_turn"])
          + "; prompt tokens computed by turn " + ", ".join(f"{x:g}" for x in r["computed_prompt_tokens_median_by_turn"])
          + f"; prompt tokens {r['prompt_tokens']}, cached {r['cached_prompt_tokens']} (device hits "
          f"{r['device_cache_hit_tokens']}, host hits {r['host_cache_hit_tokens']}); preemptions {r['preemptions']}", flush=True)
    print(f"[tier {r['tier']}] host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items())
          + f"; step() calls over 100 ms: {r['step_calls_over_100ms']}, slowest "
          + ", ".join(f"{x:.0f}" for x in r["slowest_step_calls_ms"]) + " ms")
    for ms, index, phases, pages in list(zip(r["slowest_step_calls_ms"], r["slowest_step_calls_index"],
                                             r["slowest_step_calls_phases_ms"], r["slowest_step_calls_pages"]))[:4]:
        print(f"[tier {r['tier']}]   a {ms:.0f} ms call (#{index}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if v >= 0.05)
              + "".join(f"; {k} {v}" for k, v in pages.items()), flush=True)
    if "profile" in r:
        print(f"[tier {r['tier']}] the profiled calls' " + harness.format_hotspots(r["profile"]), flush=True)
    if "host_tier" in r:
        h, c = r["host_tier"], r["host_copy_bytes_per_s"]
        print(f"[tier {r['tier']}] pinned memory taken at warm-up: {h['reserved_gib']:.1f} GiB in {h['reserve_s']:.1f} s", flush=True)
        print(f"[tier {r['tier']}] pages to host {h['pages_to_host']}, back to the device {h['pages_to_device']}, dropped "
              f"{h['dropped_pages']} ({h['bytes_to_host'] / 2**30:.2f} / {h['bytes_to_device'] / 2**30:.2f} GiB: "
              f"{h['copy_s_at_measured_rate']:.2f} s at the measured rates); copies ({c['memory_kind']}) device->host "
              f"{c['device_to_host'] / 1e9:.1f} GB/s, host->device {c['host_to_device'] / 1e9:.1f} GB/s "
              f"(PCIe Gen5 x16: {PCIE_GEN5_X16_BYTES_PER_S / 1e9:.0f} GB/s a direction)", flush=True)


# ------------------------------------------------------------------ all runs


def run_in_subprocess(argv: list[str], tier: str, out_dir: str) -> dict:
    """This script with `--tier TIER --out OUT_DIR` in a fresh process (its output shown here): its result."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--tier", tier, "--out", out_dir, "--name", f"multi_turn_{tier}"]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out_dir, f"multi_turn_{tier}.json")) as f:
        return json.load(f)["run"]


def matching(a: dict, b: dict) -> float:
    """The share of a's replies that b gave token for token."""
    return sum(d == b["reply_digests"].get(k) for k, d in a["reply_digests"].items()) / len(a["reply_digests"])


def compare(runs: dict) -> dict:
    """The runs side by side: TTFT and throughput ratios, and whether their replies agree. The tier restores
    the K/V the device computed, so its replies are the device run's token for token (both reuse every history's
    pages and schedule the same work); the off run computes histories again, where on bf16 a near-tie can differ."""
    off, on, device = runs["off"], runs["on"], runs["device"]
    device_put = runs.get("on-device-put")
    extra = {} if device_put is None else dict(
        ttft_median_device_put_over_on=device_put["ttft_ms"]["median"] / on["ttft_ms"]["median"],
        output_tok_s_on_over_device_put=on["output_tok_s"] / device_put["output_tok_s"],
        device_put_replies_matching_device=matching(device_put, device))
    return dict(**extra,ttft_median_off_over_on=off["ttft_ms"]["median"] / on["ttft_ms"]["median"],
                ttft_p99_off_over_on=off["ttft_ms"]["p99"] / on["ttft_ms"]["p99"],
                output_tok_s_on_over_off=on["output_tok_s"] / off["output_tok_s"],
                ttft_median_device_over_on=device["ttft_ms"]["median"] / on["ttft_ms"]["median"],
                output_tok_s_on_over_device=on["output_tok_s"] / device["output_tok_s"],
                same_tokens=matching(off, on) == 1.0, replies_matching=matching(off, on),
                on_replies_matching_device=matching(on, device))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="llama3-8b", choices=sorted(harness.NAMED_CONFIGS),
                    help="random weights of this Llama shape (benchmarks/model_configs.py)")
    ap.add_argument("--dtype", default="bfloat16", help="weights and KV pages")
    ap.add_argument("--conversations", type=int, default=64, help="C")
    ap.add_argument("--turns", type=int, default=4, help="T")
    ap.add_argument("--system-len", type=int, default=1024, help="S: the shared system prompt's ids")
    ap.add_argument("--user-len", type=int, default=256, help="U: each user message's ids")
    ap.add_argument("--reply-len", type=int, default=128, help="R: tokens each turn generates")
    ap.add_argument("--concurrency", type=int, default=16, help="turns in the engine at once (max_num_seqs)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled with a fixed seed a turn")
    ap.add_argument("--seed", type=int, default=0, help="the workload's ids, the weights and the sampling seeds")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="device KV pages (EngineConfig.num_pages); default: the running turns' at the last turn + 25%%")
    ap.add_argument("--kv-offloading-size", type=float, default=None,
                    help="GiB of host tier when on; default: every conversation's history + 25%%")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--min-token-bucket", type=int, default=None)
    ap.add_argument("--tier", default="all", choices=[*TIERS, "all"],
                    help="on-device-put: the tier's pages copied by jax.device_put; device: no tier, a pool "
                         "that holds every history; all: each of them")
    ap.add_argument("--in-process", action="store_true",
                    help="--tier all: the engines one after the other in this process (CPU smoke runs)")
    ap.add_argument("--smoke", action="store_true", help="a tiny CPU run: " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    ap.add_argument("--name", default="multi_turn", help="file stem of the JSON result")
    ap.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"), default=None,
                    help="a jax.profiler trace of each run's step() calls FIRST .. FIRST + COUNT - 1 into OUT/profile_TIER "
                         "(the slowest calls' indices are printed: #N)")
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        ap.set_defaults(**SMOKE)  # options given still win
    return ap.parse_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    size = sizes(a)
    print(f"{a.model_config}: {a.conversations} conversations x {a.turns} turns (system {a.system_len}, user {a.user_len}, "
          f"reply {a.reply_len}), concurrency {a.concurrency}; history {size['history_tokens']} tokens "
          f"({size['history_pages']} pages), device pool {size['num_pages']} pages ({size['pool_share_of_history']:.2f} "
          f"of the history; the running turns need {size['running_pages']}), host tier "
          f"{size['kv_offloading_size_gib']:.3g} GiB when on", flush=True)
    result = dict(model=a.model_config, dtype=a.dtype, args=vars(a), workload=size)
    if a.tier != "all":
        result["run"] = run_tier(a, a.tier)
        if a.tier == "on":
            result["host_copy_bytes_per_s"] = result["run"]["host_copy_bytes_per_s"]
    else:
        if a.in_process:
            runs = {tier: run_tier(a, tier) for tier in TIERS}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                runs = {tier: run_in_subprocess(argv, tier, a.out or tmp) for tier in TIERS}
        result["runs"] = runs
        result["host_copy_bytes_per_s"] = runs["on"]["host_copy_bytes_per_s"]
        result["comparison"] = compare(runs)
        c = result["comparison"]
        print(f"tier off / on: TTFT median {c['ttft_median_off_over_on']:.2f}x, P99 {c['ttft_p99_off_over_on']:.2f}x; "
              f"output tok/s on / off {c['output_tok_s_on_over_off']:.2f}x; replies matching {c['replies_matching']:.2%}; "
              f"device run / on: TTFT median {c['ttft_median_device_over_on']:.2f}x, output tok/s on / device "
              f"{c['output_tok_s_on_over_device']:.2f}x, on's replies matching the device run's "
              f"{c['on_replies_matching_device']:.2%}", flush=True)
        if "ttft_median_device_put_over_on" in c:
            print(f"copies in the programs against device_put: TTFT median {c['ttft_median_device_put_over_on']:.2f}x, "
                  f"output tok/s {c['output_tok_s_on_over_device_put']:.2f}x; device_put's replies matching the device "
                  f"run's {c['device_put_replies_matching_device']:.2%}", flush=True)
    if "host_copy_bytes_per_s" in result:
        result["pcie_gen5_x16_bytes_per_s"] = PCIE_GEN5_X16_BYTES_PER_S
    path = harness.write_result(a.out, a.name, result)
    if path:
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
