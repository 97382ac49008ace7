"""The disaggregated router (serve/router.py) between two stand-in servers (test_server_app's scripted engine, no
model, fast): what it sends the prefill server and then the decode server, what it relays, its fallback when the
prefill server fails, and that a client leaving mid-stream aborts the decode server's request. The router over real
prefill and decode processes: test_disaggregated_processes.py (extended)."""
from __future__ import annotations

import time

import httpx
import pytest

from jlight.engine.outputs import RequestOutput
from jlight.serve.router import build_router_app, handed_on
from server_process import free_port, serve_in_thread
from test_server_app import HEADERS, FakeAsyncLLM, _serve, post

HANDOFF = {"transfer_id": "t1", "first_token_id": 120, "seed": 5, "num_prompt_tokens": 2, "num_pages": 1}


class FakePrefill(FakeAsyncLLM):
    """Answers {"do_remote_decode": true} with kv_transfer_params on its final output, as a prefill process does."""

    def __init__(self):
        super().__init__()
        self.seen = []  # (stream?, kv_transfer_params) of each request, as the engine got them

    async def generate(self, prompt, sampling_params, request_id):
        self.seen.append(sampling_params.kv_transfer_params)
        async for out in super().generate(prompt, sampling_params, request_id):
            if out.finished and sampling_params.kv_transfer_params == {"do_remote_decode": True}:
                out = RequestOutput(**{**out.__dict__, "kv_transfer_params": HANDOFF})
            yield out


class FakeDecode(FakeAsyncLLM):
    def __init__(self):
        super().__init__(token_delay=0.02)
        self.seen = []  # kv_transfer_params of each request

    async def generate(self, prompt, sampling_params, request_id):
        self.seen.append(sampling_params.kv_transfer_params)
        async for out in super().generate(prompt, sampling_params, request_id):
            yield out


@pytest.fixture(scope="module")
def pd():
    prefill_gen, decode_gen = _serve(FakePrefill()), _serve(FakeDecode())
    (prefill_url, prefill), (decode_url, decode) = next(prefill_gen), next(decode_gen)
    decode.url = decode_url
    with serve_in_thread(build_router_app(prefill_url, decode_url)) as url:
        yield url, prefill, decode
    for gen in (prefill_gen, decode_gen):
        gen.close()


@pytest.fixture
def fresh(pd):
    url, prefill, decode = pd
    prefill.seen.clear()
    decode.seen.clear()
    decode.aborted.clear()
    return pd


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_goes_through_prefill_then_decode(fresh, path, body, stream):
    url, prefill, decode = fresh
    body = {**body, "stream": stream}
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    assert prefill.seen == [{"do_remote_decode": True}]  # not streamed, whatever the client asked
    assert decode.seen == [HANDOFF]  # the prefill's answer, with the client's own body
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream") and r.text.rstrip().endswith("data: [DONE]")
    else:
        assert "kv_transfer_params" not in r.json() and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "n": 2}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"prompt": "hi", "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
])
def test_requests_that_cannot_be_handed_on_go_to_the_decode_server_alone(fresh, path, body):
    url, prefill, decode = fresh
    assert not handed_on(path, body)
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    assert prefill.seen == [] and decode.seen == [None] * len(decode.seen) and decode.seen


def test_a_client_error_comes_back_from_the_prefill_server(fresh):
    url, prefill, decode = fresh
    r = post(url, "/v1/completions", {"prompt": "hi", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert decode.seen == []
    r = post(url, "/v1/completions", {"prompt": "hi"}, headers={})  # the client's Authorization is passed on
    assert r.status_code == 401


def test_a_failed_prefill_loses_nothing(pd):
    _, _, decode = pd
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with serve_in_thread(build_router_app(dead, decode.url)) as url:
        decode.seen.clear()
        r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert decode.seen == [None]  # computed whole on the decode server
        assert 'jlight_router_requests_total{route="prefill_failed"} 1' in httpx.get(url + "/metrics").text
        assert httpx.get(url + "/health").status_code == 503


def test_leaving_mid_stream_aborts_the_decode_request(fresh):
    url, prefill, decode = fresh
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True},
                      headers=HEADERS, timeout=20) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.time() + 5
    while not decode.aborted and time.time() < deadline:
        time.sleep(0.02)
    assert decode.aborted and not decode.active


def test_health_and_models(pd):
    url, _, _ = pd
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models", headers=HEADERS).json()["data"][0]["id"] == "fake-model"


@pytest.mark.parametrize("argv, words", [
    (["--disaggregated-role", "prefill"], "needs --coordinator-address"),
    (["--coordinator-address", "127.0.0.1:1"], "go with --disaggregated-role"),
    (["--disaggregated-role", "router", "--prefill", "http://a"], "needs --prefill URL and --decode URL"),
    (["m", "--disaggregated-role", "router", "--prefill", "http://a", "--decode", "http://b"], "loads no model"),
    (["--prefill", "http://a"], "are the router's"),
    (["--disaggregated-role", "decode", "--coordinator-address", "10.0.0.1:1"], "--kv-transfer-address"),
    (["--disaggregated-role", "decode", "--coordinator-address", "nowhere"], "must be 'host:port'"),
    (["--disaggregated-role", "decode", "--coordinator-address", "127.0.0.1:1", "--kv-transfer-address", "h:0"],
     "a port other than 0"),
])
def test_role_flags_are_checked_before_anything_starts(argv, words, capsys):
    from jlight.serve import cli

    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err
