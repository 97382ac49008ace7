"""The chaos suite (benchmarks/chaos_cases.py) against a real `jlight serve` of a tiny model, on
127.0.0.1 in a subprocess (`benchmarks/chaos.py serve`: the server plus one injected fault, a step
that raises when it schedules the poisoned prompt), at CI sizes.

What each case promises is in chaos_cases.py's docstring and docs/ARCHITECTURE.md. Two of them
reproduce what a new user saw go wrong: a 5 MB chat body stalled /health for seconds
(test_health_answers_while_a_huge_request_is_prepared, test_an_oversized_body_does_not_stall_a_stream),
and SIGTERM cut streams mid-chunk (test_sigterm_ends_every_stream_cleanly). One server for the
module; the SIGTERM test stops it, so it runs last.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import http.client
import subprocess
import sys
import time
import urllib.parse
import tracemalloc

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import chaos_cases  # noqa: E402
from chaos_client import Target  # noqa: E402
from jlight.engine.outputs import CompletionOutput, PackedLogprobs, RequestOutput  # noqa: E402
from jlight.serve.responses import ResponseBuilder, TokenText  # noqa: E402
from server_process import free_port, server_process  # noqa: E402

MAX_MODEL_LEN = 1024
DRAIN_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def chaos_server(tiny_model, tmp_path_factory):
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=MAX_MODEL_LEN)
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("chaos") / "server.log")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "chaos.py"), "serve", model, "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
           "--max-num-batched-tokens", "64", "--shutdown-timeout", str(DRAIN_TIMEOUT_S), "--log-level", "info"]
    with server_process(cmd, port, log_path) as (url, proc):
        target = asyncio.run(Target(url, server_pid=proc.pid, drain_timeout_s=DRAIN_TIMEOUT_S).connect())
        yield target, proc, log_path


def _run(case, server, **kw):
    """Runs the chaos case against the module's server; a failure carries the tail of the server's log."""
    target, _, log_path = server
    try:
        return asyncio.run(case(target, **kw))
    except Exception as e:
        with open(log_path, errors="replace") as log:
            tail = log.read()[-4000:]
        raise AssertionError(f"{type(e).__name__}: {e}\n--- the server's log, last lines ---\n{tail}") from e


def test_an_idle_connection_outlives_a_client_expiry(chaos_server):
    """The server keeps an idle connection open past httpx's default expiry (5 s): uvicorn's default
    keep-alive, also 5 s, let a client reuse a connection the server was closing, and that request
    failed with a reset (seen once in 1,200 requests of test_many_requests_leave_memory_flat)."""
    url = urllib.parse.urlsplit(chaos_server[0].base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        for idle_s in (0, httpx.Limits().keepalive_expiry + 1):
            time.sleep(idle_s)
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and response.read()
            conn.auto_open = 0  # the second request must go over the same connection (else NotConnected)
    finally:
        conn.close()


def test_health_answers_while_a_huge_request_is_prepared(chaos_server):
    """Fails on the code before the host pool and the size budget: /health waited ~3 s."""
    report = _run(chaos_cases.health_during_huge_request, chaos_server)
    assert set(report) == {"/v1/chat/completions", "/v1/completions"}


def test_bad_inputs_name_their_field(chaos_server):
    target = chaos_server[0]
    assert _run(chaos_cases.bad_inputs, chaos_server)["cases"] == len(chaos_cases.bad_input_table(target)) > 20


def test_disconnect_storm_frees_the_pool(chaos_server):
    report = _run(chaos_cases.disconnect_storm, chaos_server)
    assert report["outcomes"].get("client_disconnect", 0) >= 1


def test_slow_readers_hold_memory_flat(chaos_server):
    """Fails on the code before AsyncLLM's one-output mailbox: 3 silent readers cost ~45 MB. At this
    size the read streams' own high-water mark hides what a silent stream keeps (12 readers, the H200's
    count, grew the server 30-45 MB before packed unsent logprobs and piecewise chunks, ~5 MB after:
    too slow for CI); the two tests of that mechanism are test_a_merged_delta_streams_in_small_pieces_...
    here and test_async_engine's test_an_unread_stream_holds_only_its_unsent_tokens_packed."""
    _run(chaos_cases.slow_readers, chaos_server)


class _ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id):
        return bytes([token_id])


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_merged_delta_streams_in_small_pieces_rendered_one_at_a_time(kind):
    """What a silent reader's stream renders when its merged output comes up: chunks of at most
    `piece_tokens` tokens' logprobs, each rendered when taken (the code before rendered one chunk per
    choice of the whole delta, all choices at once: megabytes a reader with n=8 and top_logprobs=20)."""
    tokens, n, top = 300, 2, 20
    ids = [97 + i % 26 for i in range(tokens)]
    entry = lambda t: {**{98 + k: -1.0 - k for k in range(top)}, t: -0.5}  # noqa: E731
    outs = [CompletionOutput(index=i, text=bytes(ids).decode(), token_ids=ids, finish_reason="length",
                             logprobs=PackedLogprobs(entry(t) for t in ids), text_delta=bytes(ids).decode(),
                             token_ids_delta=ids) for i in range(n)]
    out = RequestOutput("r-0", None, [1, 2], outs, finished=True)
    builder = ResponseBuilder(kind, "r", "m", _ByteTokenizer(), n, want_logprobs=True, num_top_logprobs=top)
    rendered = builder.stream_chunks(0, out)
    assert iter(rendered) is rendered  # an iterator: each chunk rendered as the one before is sent
    sizes, choices = [], []
    for chunk in rendered:
        sizes.append(len(chunk))
        choices.append(json.loads(chunk[len("data: "):])["choices"][0])
    assert max(sizes) < 64 * 1024 and len(choices) == n * -(-tokens // builder.piece_tokens)
    for i in range(n):
        mine = [c for c in choices if c["index"] == i]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        if kind == "chat":
            assert "".join(c["delta"]["content"] for c in mine) == bytes(ids).decode()
            got = [lp for c in mine for lp in c["logprobs"]["content"]]
            assert [lp["token"] for lp in got] == [chr(t) for t in ids]
            assert all(lp["logprob"] == -0.5 and len(lp["top_logprobs"]) == top for lp in got)
        else:
            assert "".join(c["text"] for c in mine) == bytes(ids).decode()
            offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
            assert offsets == list(range(tokens))  # as one chunk would have them
            assert [v for c in mine for v in c["logprobs"]["token_logprobs"]] == [-0.5] * tokens


class _WideTokenizer:
    """A Llama-3-sized vocabulary, each token a few characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i:x}" for i in ids)

    def token_bytes(self, token_id):
        return f" w{token_id:x}".encode()


def test_a_stream_holds_no_token_cache_of_its_own():
    """A builder caching token texts for its own request held them while its client did not read: at a
    128k vocabulary with top_logprobs=20, ~16 MB for one n=8 stream of 500 tokens; the server's builders
    share one cache, bounded by the vocabulary."""
    vocab, tokens, n, top = 128256, 200, 2, 20
    rng = random.Random(0)
    outs = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(tokens)]
        lps = PackedLogprobs({**{rng.randrange(vocab): -1.0 - k for k in range(top)}, t: -0.5} for t in ids)
        outs.append(CompletionOutput(index=i, text="", token_ids=ids, finish_reason="length", logprobs=lps,
                                     text_delta=_WideTokenizer().decode(ids), token_ids_delta=ids))
    out = RequestOutput("r-0", None, [1, 2], outs, finished=True)

    def held_after_rendering(token_text):
        """(bytes the builder holds once its stream is rendered, the builder, its first chunk)"""
        gc.collect()
        tracemalloc.start()
        try:
            builder = ResponseBuilder("chat", "r", "m", _WideTokenizer(), n, want_logprobs=True, num_top_logprobs=top,
                                      token_text=token_text)
            first = None
            for chunk in builder.stream_chunks(0, out):
                first = first or json.loads(chunk[len("data: "):])
            gc.collect()
            return tracemalloc.get_traced_memory()[0], builder, first
        finally:
            tracemalloc.stop()

    shared = TokenText(_WideTokenizer())
    held_after_rendering(shared)  # another request rendered these tokens before
    own = held_after_rendering(None)[0]
    alone, builder, first = held_after_rendering(shared)
    assert builder.token_text is shared and len(shared) > 5000
    entry = first["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == list(entry["token"].encode())
    assert own > 2**20 and own > 4 * alone, (own, alone)


def test_the_token_cache_stays_small_at_a_whole_vocabulary():
    """Every text and bytes of a 128k vocabulary cached: under 16 MB (two dicts keyed by int held 21.6 MB, and grew
    by megabytes at each resize, which a slow reader's rendering could trigger), each token's text its own."""
    class Sized(_WideTokenizer):
        vocab_size = 128256

    gc.collect()
    tracemalloc.start()
    try:
        cache = TokenText(Sized())
        for i in range(Sized.vocab_size):
            cache(i), cache.bytes(i)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(cache) == Sized.vocab_size and held < 16 * 2**20, held
    assert cache(0x1f) == " w1f" and cache.bytes(0x1f) == list(b" w1f")
    assert cache(Sized.vocab_size + 5) == f" w{Sized.vocab_size + 5:x}" and len(cache) == Sized.vocab_size + 1  # past the end


def test_an_oversized_body_does_not_stall_a_stream(chaos_server):
    """Fails on the code before the host pool and the size budget: the stream's gap was ~4 s."""
    _run(chaos_cases.oversized_body_during_stream, chaos_server)


def test_a_failing_step_fails_only_its_requests(chaos_server):
    report = _run(chaos_cases.step_failure, chaos_server)
    assert report["served_after"] == 8


def test_many_requests_leave_memory_flat(chaos_server):
    report = _run(chaos_cases.many_requests_flat_rss, chaos_server)
    assert report["requests"] == 1000


def test_sigterm_ends_every_stream_cleanly(chaos_server):
    """Runs last: stops the module's server. Fails on the code before serve/drain.py: /health refused
    connections after SIGTERM, and streams were cut at the deadline."""
    target, proc, log_path = chaos_server
    log_start = os.path.getsize(log_path)

    def exited(timeout_s):
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    report = _run(chaos_cases.sigterm_mid_stream, chaos_server, wait_exit=exited)
    assert report["endings"].get("abort", 0) >= 1
    assert proc.returncode == 0
    with open(log_path) as f:
        f.seek(log_start)
        shutdown_log = f.read()
    assert "drain deadline" in shutdown_log and "Traceback" not in shutdown_log and " ERROR " not in shutdown_log, \
        shutdown_log[-3000:]
