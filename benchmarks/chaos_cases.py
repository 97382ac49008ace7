"""The chaos suite's cases: each abuses a running `jlight serve` from outside and checks a promise.

Every case is `async def case(target, ...) -> dict` (what it measured) and raises ChaosFailure
when a promise breaks. Their sizes default to the CI run's (a tiny model on a 2-core CPU);
benchmarks/chaos.py scales them up for a GPU server. Timing bounds hold on a loaded host because
a case that measures latency tries again (`attempts`): a stall of the server's own making shows
in every attempt, a host that was busy elsewhere for a moment in one.

health_during_huge_request  a 5 MB chat body and a 5 MB prompt (under the body limit, far over the
                            context): each refused with a 400 naming its field in under a second, and
                            /health and /metrics answer within 50 ms all the while
bad_inputs                  a table of bad requests: each gets its 4xx and names its field
disconnect_storm            streams with a quarter of clients leaving midway: the KV pool is free
                            within 2 s and the outcome counters add up to the requests sent
slow_readers                clients that never read their streams: the server's memory stays flat
                            (no more than for readers), their KV pages are freed once generated, other
                            streams are not stalled
oversized_body_during_stream  huge bodies (refused) sent while a stream runs: its inter-token gap
                            stays under 100 ms
step_failure                an engine step that raises (the server must run benchmarks/chaos.py serve,
                            which fails any step holding POISON_PROMPT): that request gets a 500 naming
                            it, the others finish or get an error naming themselves, the server serves on
many_requests_flat_rss      1,000 requests: all answered, the server's memory flat
sigterm_mid_stream          SIGTERM with streams running: /health 503 "draining" at once, new requests
                            503 + Retry-After, streams run on, at the deadline every one ends with
                            finish_reason "abort" and [DONE] (non-streaming: whole JSON), the process
                            exits 0 (the caller checks its log for tracebacks)
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time

import httpx

from chaos_client import (PY_BLOCKS_METRIC, ChaosFailure, Target, chat, check, completion, metrics, outcome_deltas,
                          pid_alive, post_in_thread, raw_request, server_rss_mb, silent_reader, stream, wait_pool_free)

# The prompt whose steps fail on a server started by `benchmarks/chaos.py serve` (token ids valid in any vocabulary).
POISON_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
HUGE_TEXT_UNIT = "The quick brown fox jumps over the lazy dog. "


def huge_text(megabytes: float) -> str:
    return HUGE_TEXT_UNIT * int(megabytes * 2**20 / len(HUGE_TEXT_UNIT))


def _room(target: Target, prompt_tokens: int = 16) -> int:
    """Tokens a request with a short prompt can generate."""
    return max(1, target.max_model_len - prompt_tokens)


async def _worst_poll_while(client: httpx.AsyncClient, task: asyncio.Future) -> tuple[float, int]:
    """Poll /health and /metrics in turn until `task` is done; (slowest answer in s, polls made)."""
    worst, polls = 0.0, 0
    while not task.done() or polls == 0:
        start = time.perf_counter()
        r = await client.get("/health" if polls % 2 == 0 else "/metrics")
        worst = max(worst, time.perf_counter() - start)
        check(r.status_code == 200, f"{r.url.path} answered {r.status_code} while a huge request was prepared")
        polls += 1
        await asyncio.sleep(0.005)
    return worst, polls


def _error_of(r: httpx.Response) -> dict:
    try:
        return r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": r.text[:200], "param": None}


async def health_during_huge_request(target: Target, megabytes: float = 5.0, bound_s: float = 0.05,
                                     refuse_s: float = 1.0, attempts: int = 3) -> dict:
    text = huge_text(megabytes)
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
              ("/v1/completions", {"prompt": text}, "prompt")]
    report = {}
    async with target.client() as c:
        for path, body, param in bodies:
            raw = json.dumps(body).encode()
            tries = []
            for _ in range(attempts):
                task = asyncio.ensure_future(post_in_thread(target, path, raw))
                worst, polls = await _worst_poll_while(c, task)
                r, took = task.result()
                error = _error_of(r)
                check(r.status_code == 400 and error.get("param") == param,
                      f"{path} with {len(raw) / 2**20:.1f} MB: expected a 400 naming {param}, got {r.status_code} {error}")
                tries.append({"slowest_poll_s": round(worst, 4), "polls": polls, "refused_in_s": round(took, 3)})
                if worst < bound_s and took < refuse_s:
                    break
            report[path] = tries
            check(tries[-1]["slowest_poll_s"] < bound_s,
                  f"while {path} prepared {len(raw) / 2**20:.1f} MB, /health or /metrics took "
                  f"{[t['slowest_poll_s'] for t in tries]} s in {len(tries)} attempts (promise: < {bound_s} s)")
            check(tries[-1]["refused_in_s"] < refuse_s,
                  f"{path} with {len(raw) / 2**20:.1f} MB was refused after {[t['refused_in_s'] for t in tries]} s "
                  f"(the size budget refuses it untokenized, promise: < {refuse_s} s)")
    return report


def bad_input_table(target: Target) -> list[tuple[str, object, int, str | None]]:
    """(path, JSON body or raw bytes, status, the error's param) for this server's limits."""
    big = huge_text(min(5.0, target.max_body_bytes / 2**20 / 2))
    too_many_ids = [1] * target.max_model_len
    user = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/completions", {"prompt": "hi", "max_tokens": target.max_model_len}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": big}, 400, "prompt"),
        ("/v1/completions", {"prompt": too_many_ids}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 1000}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 10**4}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 100}, 400, "stop"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "[a-"}, 400, "guided_regex"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": user * target.max_model_len}, 400, "messages"),
        ("/v1/chat/completions", {"messages": user, "top_logprobs": 3}, 400, "top_logprobs"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/v1/completions", b'{"prompt": "hi", ', 400, None),  # not JSON
        ("/v1/completions", b'{"prompt": "\xff"}', 400, None),  # not UTF-8
        ("/v1/completions", b"x" * (target.max_body_bytes + 1), 413, None),
    ]


async def bad_inputs(target: Target) -> dict:
    wrong = []
    async with target.client() as c:
        for path, body, status, param in bad_input_table(target):
            if isinstance(body, bytes):
                r = await c.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = await c.post(path, json=body)
            error = _error_of(r)
            if r.status_code != status or error.get("param") != param or not error.get("message"):
                shown = {k: (v[:40] + "..." if isinstance(v, str) and len(v) > 40 else v)
                         for k, v in body.items()} if isinstance(body, dict) else body[:40]
                wrong.append(f"{path} {shown}: expected {status} naming {param}, got {r.status_code} {error}")
        r = await c.get("/health")
    check(not wrong, f"{len(wrong)} bad inputs answered wrongly:\n" + "\n".join(wrong))
    check(r.status_code == 200, f"/health answered {r.status_code} after the bad inputs")
    return {"cases": len(bad_input_table(target))}


async def disconnect_storm(target: Target, streams: int = 48, leave_fraction: float = 0.25, max_tokens: int = 32,
                           free_within_s: float = 2.0, seed: int = 0) -> dict:
    rng = random.Random(seed)
    leavers = set(rng.sample(range(streams), int(streams * leave_fraction)))
    async with target.client() as c:
        before = await metrics(c)
        results = await asyncio.gather(*[
            stream(c, "/v1/completions", completion(f"Story {i}: once upon a time", max_tokens, ignore_eos=True,
                                                    temperature=0.8, seed=i),
                   leave_after=rng.randint(1, 8) if i in leavers else None) for i in range(streams)])
        for i, s in enumerate(results):
            if i not in leavers:
                s.check_clean_end(f"stream {i}", ("length",))
        freed_s = await wait_pool_free(c, free_within_s)
        deltas = outcome_deltas(before, await metrics(c))
    finished, left = streams - len(leavers), len(leavers)
    check(sum(deltas.values()) == streams, f"{streams} requests, but the outcome counters moved by {deltas}")
    check(1 <= deltas.get("client_disconnect", 0) <= left and deltas.get("length", 0) >= finished
          and set(deltas) <= {"length", "client_disconnect"},
          f"{finished} finished and {left} left, but the counters say {deltas}")
    return {"streams": streams, "left": left, "pool_free_after_s": round(freed_s, 3), "outcomes": deltas}


async def slow_readers(target: Target, readers: int = 3, samples: int = 8, others: int = 8, max_tokens: int = 500,
                       slack_mb: float = 16.0, stall_s: float = 1.0, min_stream_mb: float = 4.5,
                       generated_within_s: float = 120.0) -> dict:
    """The same requests read by clients that read and by clients that never do: the second costs the
    server no more memory (it holds each stream's unsent tokens merged into one output, their logprobs
    packed, and one small rendered chunk: not every output since, nor the logprobs already sent, nor a
    whole merged delta rendered at once; at 12 readers the code before held ~30-45 MB). Each stream
    carries more than min_stream_mb, past what a loopback socket's kernel buffers take in (~3 MB a
    connection with Linux's default tcp_wmem), so the server's own sending must wait."""
    max_tokens = min(max_tokens, _room(target, 64))
    body = chat("Tell me a long story.", max_tokens, n=samples, temperature=1.0, seed=1, ignore_eos=True,
                logprobs=True, top_logprobs=20)
    beside = [completion(f"Count {i}:", 64, ignore_eos=True) for i in range(others)]
    async with target.client() as c:
        # The read phase runs the silent phase's whole mix (the streams and the requests beside them), so
        # that memory the mix itself costs once (a step shape's first run, allocator growth) is in `base`.
        both = await asyncio.gather(*[stream(c, "/v1/chat/completions", body) for _ in range(readers)],
                                    *[stream(c, "/v1/completions", b) for b in beside])
        read = both[:readers]
        for i, s in enumerate(read):
            s.check_clean_end(f"read stream {i}", ("length",), choices=samples)
        stream_mb = min(s.num_bytes for s in read) / 2**20
        check(stream_mb > min_stream_mb, f"a stream carries only {stream_mb:.1f} MB: the socket buffers would take it "
                                         f"all, and nothing would test the server's back-pressure")
        base = await server_rss_mb(target, c)  # its high-water mark covers these requests read as they come
        base_blocks = (await metrics(c)).get(PY_BLOCKS_METRIC)
        socks = await asyncio.gather(*[silent_reader(target, raw_request(target, "/v1/chat/completions",
                                                                           {**body, "stream": True}))
                                       for _ in range(readers)])
        try:
            normal = await asyncio.gather(*[stream(c, "/v1/completions", b) for b in beside])
            for i, s in enumerate(normal):
                s.check_clean_end(f"stream {i} beside the silent readers", ("length",))
            gaps = [s.max_gap(s.times[0], s.times[-1]) for s in normal]
            check(max(gaps) < stall_s, f"streams beside {readers} silent readers stalled: gaps {max(gaps):.2f} s")
            # The engine does not wait for readers: their requests finish and free their pages.
            generated_s = await wait_pool_free(c, generated_within_s)
            held = await server_rss_mb(target, c)
            held_blocks = (await metrics(c)).get(PY_BLOCKS_METRIC)
        finally:
            for sock in socks:
                sock.close()
        await wait_pool_free(c, 10)
    blocks = "" if base_blocks is None or held_blocks is None else f"; Python's allocator {held_blocks - base_blocks:+.0f} blocks"
    check(held - base < slack_mb, f"{readers} clients that never read their {stream_mb:.0f} MB streams grew the "
                                  f"server by {held - base:.1f} MB beyond what the same streams read took "
                                  f"(bound {slack_mb} MB{blocks})")
    return {"readers": readers, "stream_mb": round(stream_mb, 1), "rss_growth_mb": round(held - base, 1),
            "python_blocks_growth": None if base_blocks is None or held_blocks is None else int(held_blocks - base_blocks),
            "others_max_gap_s": round(max(gaps), 4), "generated_after_s": round(generated_s, 2)}


async def oversized_body_during_stream(target: Target, gap_s: float = 0.1, megabytes: float = 5.0,
                                       attempts: int = 3) -> dict:
    text = huge_text(megabytes)
    bigs = [("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}]}).encode(), 400),
            ("/v1/completions", json.dumps({"prompt": text}).encode(), 400),
            ("/v1/completions", b"x" * (target.max_body_bytes + 2**20), 413)]
    tries = []
    async with target.client() as c:
        for _ in range(attempts):
            started = asyncio.Event()
            task = asyncio.ensure_future(stream(c, "/v1/completions", completion("Once upon a time", _room(target),
                                                                                 ignore_eos=True),
                                                on_event=lambda s: len(s.events) >= 5 and started.set()))
            await asyncio.wait_for(started.wait(), 60)
            window_start = time.perf_counter()
            for path, raw, status in bigs:
                r, _ = await post_in_thread(target, path, raw)
                check(r.status_code == status, f"{path} with {len(raw) / 2**20:.1f} MB: {r.status_code}, expected {status}")
            window_end = time.perf_counter()
            s = await task
            s.check_clean_end("the stream", ("length",))
            check(s.times[-1] > window_end, "the stream ended before the huge requests were answered: it measured "
                                            "nothing; give it more tokens (a larger max_model_len)")
            tries.append(round(s.max_gap(window_start, window_end), 4))
            if tries[-1] < gap_s:
                break
    check(tries[-1] < gap_s, f"while huge bodies were refused, a stream's longest gap was {tries} s in "
                             f"{len(tries)} attempts (promise: < {gap_s} s)")
    return {"max_gap_s": tries}


async def step_failure(target: Target, bystanders: int = 4, after: int = 8) -> dict:
    id_pattern = re.compile(r"request (cmpl-[0-9a-f]+)-0 failed in the engine")
    async with target.client() as c:
        flowing = asyncio.Event()
        opened = set()

        def on_event(s):
            opened.add(id(s))
            if len(opened) == bystanders:
                flowing.set()
        running = [asyncio.ensure_future(stream(c, "/v1/completions", completion(f"Bystander {i}", _room(target),
                                                                                 ignore_eos=True), on_event=on_event))
                   for i in range(bystanders)]
        await asyncio.wait_for(flowing.wait(), 60)
        poisoned = await c.post("/v1/completions", json=completion(POISON_PROMPT, 8))
        poisoned_stream = await stream(c, "/v1/completions", completion(POISON_PROMPT, 8))
        others = await asyncio.gather(*running)
        later = await asyncio.gather(*[c.post("/v1/completions", json=completion(f"After {i}", 8)) for i in range(after)])
        health = await c.get("/health")
        await wait_pool_free(c, 10)
    error = _error_of(poisoned)
    check(poisoned.status_code == 500 and id_pattern.search(error.get("message", "")) is not None,
          f"the poisoned request got {poisoned.status_code} {error}; expected a 500 naming it (is the server "
          f"benchmarks/chaos.py serve, which fails its steps?)")
    stream_error = poisoned_stream.events[0] if poisoned_stream.events else ""
    check(poisoned_stream.status == 500 and id_pattern.search(stream_error) is not None,
          f"the poisoned stream got {poisoned_stream.status} {stream_error[:200]}; expected a 500 naming it")
    failed = 0
    for i, s in enumerate(others):
        if s.errors():
            failed += 1
            named = id_pattern.search(s.errors()[0]["message"])
            check(named is not None and s.chunks()[0]["id"] == named.group(1) and s.done,
                  f"bystander {i} failed without naming itself: {s.errors()}")
        else:
            s.check_clean_end(f"bystander {i}", ("length",))
    check(all(r.status_code == 200 for r in later), f"after the failure: {[r.status_code for r in later]}")
    check(health.status_code == 200, f"/health answered {health.status_code} after one failed step")
    return {"bystanders_failed": failed, "bystanders": bystanders, "served_after": after}


async def many_requests_flat_rss(target: Target, requests: int = 1000, concurrency: int = 32, warmup: int = 200,
                                 growth_mb: float = 16.0) -> dict:
    bodies = [("/v1/completions", completion("Hello there", 4)), ("/v1/chat/completions", chat("Hi!", 4)),
              ("/v1/completions", completion("Count: 1 2 3", 4, stream=True)), ("/v1/completions", completion([5, 6, 7], 4))]
    gate = asyncio.Semaphore(concurrency)

    async def one(c, i):
        path, body = bodies[i % len(bodies)]
        async with gate:
            r = await c.post(path, json=body)
            return r.status_code

    async with target.client() as c:
        codes = await asyncio.gather(*[one(c, i) for i in range(warmup)])
        before_m, before_mb = await metrics(c), await server_rss_mb(target, c)
        start = time.perf_counter()
        codes += await asyncio.gather(*[one(c, i) for i in range(requests)])
        took = time.perf_counter() - start
        after_m, after_mb = await metrics(c), await server_rss_mb(target, c)
    bad = [code for code in codes if code != 200]
    check(not bad, f"{len(bad)} of {len(codes)} requests failed: {sorted(set(bad))}")
    deltas = outcome_deltas(before_m, after_m)
    check(sum(deltas.values()) == requests, f"{requests} requests, but the outcome counters moved by {deltas}")
    growth = after_mb - before_mb
    check(growth < growth_mb, f"{requests} requests grew the server by {growth:.1f} MB (bound {growth_mb} MB)")
    return {"requests": requests, "seconds": round(took, 2), "rss_growth_mb": round(growth, 1), "outcomes": deltas}


async def sigterm_mid_stream(target: Target, streams: int = 32, non_streaming: int = 2, exit_within_s: float = 15.0,
                             wait_exit=None) -> dict:
    """`wait_exit(timeout_s) -> bool`: whether the server process is gone (default: polls target.server_pid)."""
    check(target.server_pid is not None, "sigterm_mid_stream needs the server's pid (--server-pid)")
    max_tokens = _room(target)
    body = completion("Once upon a time", max_tokens, ignore_eos=True)
    async with target.client() as c:
        first, flowing = asyncio.Event(), asyncio.Event()
        opened = set()

        def on_event(s):
            opened.add(id(s))
            first.set()
            if len(opened) == streams:
                flowing.set()
        tasks = [asyncio.ensure_future(stream(c, "/v1/completions", body, on_event=on_event)) for _ in range(streams)]
        tasks += [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(non_streaming)]
        # Every stream flowing, or those the engine took at once (it may run fewer sequences than were sent:
        # the others wait, and must end as cleanly).
        await asyncio.wait_for(first.wait(), 120)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(flowing.wait(), 1.0)
        signalled = time.perf_counter()
        os.kill(target.server_pid, signal.SIGTERM)
        broken = []  # every promise broken, so that one run shows them all
        health = None
        for _ in range(100):
            try:
                health = await c.get("/health")
            except httpx.HTTPError as e:
                broken.append(f"after SIGTERM, /health got no answer ({type(e).__name__}: {e}): the server stopped "
                              f"listening instead of draining")
                break
            if health.status_code == 503:
                break
            await asyncio.sleep(0.01)
        draining_after = time.perf_counter() - signalled
        if health is not None and (health.status_code, health.text) != (503, "draining"):
            broken.append(f"/health answered {health.status_code} {health.text!r} {draining_after:.2f} s after SIGTERM")
        try:
            refused = await c.post("/v1/completions", json=completion("late", 4))
            if not (refused.status_code == 503 and "Retry-After" in refused.headers
                    and _error_of(refused).get("code") == "draining"):
                broken.append(f"a new request while draining got {refused.status_code} {refused.text[:200]}")
        except httpx.HTTPError as e:
            broken.append(f"a new request while draining got no answer ({type(e).__name__})")
        results = await asyncio.gather(*tasks, return_exceptions=True)
    endings, cut = [], []
    for i, s in enumerate(results[:streams]):
        try:
            endings.append(s.check_clean_end(f"stream {i}", ("length", "abort")))
        except ChaosFailure as e:
            cut.append(str(e))
    if cut:
        broken.append(f"{len(cut)} of {streams} streams did not end cleanly, e.g. {cut[0]}")
    drain_seen = signalled + draining_after
    # Of the streams that flowed when the signal came, each got tokens after the drain began (besides its
    # last chunk and [DONE]): it ran on.
    was_flowing = [s for s in results[:streams] if s.times and s.times[0] < signalled]
    ran_on = sum(1 for s in was_flowing if sum(t > drain_seen for t in s.times) > 2)
    if ran_on < len(was_flowing):
        broken.append(f"only {ran_on} of the {len(was_flowing)} streams flowing at SIGTERM went on after the drain began")
    for r in results[streams:]:
        ok = isinstance(r, httpx.Response) and r.status_code == 200
        reason = r.json()["choices"][0]["finish_reason"] if ok else None
        if reason not in ("length", "abort"):
            broken.append(f"a non-streaming request in flight got {r.status_code if ok else r!r} "
                          f"{r.text[:200] if isinstance(r, httpx.Response) else ''}")
        endings.append(f"non-streaming {reason}")
    reasons = {reason: endings.count(reason) for reason in sorted(set(endings), key=str)}
    if not broken and reasons.get("abort", 0) == 0:
        broken.append(f"every stream finished before the drain deadline ({reasons}): nothing tested the deadline; "
                      f"run longer streams or a shorter --shutdown-timeout")
    ended = [s.times[-1] for s in results[:streams] if s.times]
    last_end = max(ended) - signalled if ended else 0.0
    if last_end > target.drain_timeout_s + 2:
        broken.append(f"the last stream ended {last_end:.1f} s after SIGTERM (deadline {target.drain_timeout_s} s)")
    wait_exit = wait_exit or (lambda timeout: _poll_gone(target.server_pid, timeout))
    if not await asyncio.to_thread(wait_exit, exit_within_s):
        broken.append(f"the server still runs {exit_within_s} s after SIGTERM")
    check(not broken, "; ".join(broken))
    return {"draining_after_s": round(draining_after, 3), "flowing_at_sigterm": len(was_flowing), "endings": reasons,
            "last_stream_end_s": round(last_end, 2)}


def _poll_gone(pid: int, timeout_s: float) -> bool:
    end = time.time() + timeout_s
    while time.time() < end:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


CASES = {f.__name__: f for f in (health_during_huge_request, bad_inputs, disconnect_storm, slow_readers,
                                 oversized_body_during_stream, step_failure, many_requests_flat_rss, sigterm_mid_stream)}
__all__ = ["CASES", "ChaosFailure", "POISON_PROMPT", "Target"]
