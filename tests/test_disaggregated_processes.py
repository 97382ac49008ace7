"""Disaggregated prefill and decode as two processes (jlight/engine/disaggregated_roles.py, kv_channel.py): a
prefill process and a decode process, each with 2 simulated CPU devices and a tp=2 mesh over them, joined by
jax.distributed on loopback, the pages moved by cross-process jax.device_put (JAX's socket transfers on CPU).
The test script plays the router through the job's key-value store: it hands each prefill's kv_transfer_params to
the decode process. A batch of mixed requests gives exactly the tokens of one engine (tp=2, built in the decode
process first), while
- one request is aborted while its pages are in flight (its decode pages are freed at once, its prefill pages once
  the prefill process has answered the order);
- three handoffs fail and are recomputed on the decode side: the copy fails when polled (injected in the decode
  process), reading the pages fails (injected in the prefill process), and a transfer id the prefill process never
  held;
- one prefill's kv_transfer_params never reach the decode side (a client that left between the two): the prefill
  process releases its pages after kv_transfer_timeout_s;
and at the end neither process holds a page. The extended test runs `jlight serve` as the two roles and the router
(serve/router.py), three processes, and checks the answers over HTTP."""
import json
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest

from jlight.serve.metrics import parse_metrics
from server_process import free_port
from simulated_devices import simulated_env

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, time
    role, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from jlight.engine.disaggregated_roles import join_pair
    join_pair(role, f"127.0.0.1:{port}")
    import jax, numpy as np, jlight
    from jlight import SamplingParams
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine
    from jlight.sharding.distributed import key_value_store

    store = key_value_store()
    put = lambda key, value: store.key_value_set("test/" + key, json.dumps(value))
    def get(key):
        try:
            return json.loads(store.key_value_try_get("test/" + key))
        except Exception:
            return None

    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, page_size=8,
                num_pages=96, max_model_len=256)
    rng = np.random.default_rng(0)
    lens = (5, 40, 130, 17, 64, 9, 33, 90, 21, 12)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in lens]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0.8, n=2, max_tokens=6, seed=3),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
              greedy, greedy, greedy, greedy]
    DIRECT = {"r4"}  # n=2: the router sends it to the decode server alone
    LOST = "r9"  # its kv_transfer_params never reach the decode side
    BOGUS = "r8"  # the decode side gets a transfer id the prefill never held
    ids = [f"r{i}" for i in range(len(prompts))]
    handed = [r for r in ids if r not in DIRECT]

    if role == "decode":  # the reference first: the prefill process holds its pages meanwhile
        single = LLMEngine(EngineConfig(model, mesh="tp=2", **opts), devices=jax.local_devices())
        for i, rid in enumerate(ids):
            if rid != LOST:
                single.add_request(rid, None, params[i], prompt_token_ids=prompts[i])
        want = {}
        while single.has_unfinished_requests():
            for o in single.step():
                if o.finished:
                    want[o.request_id] = [[c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]]
        del single

    engine = jlight.LLM(model, disaggregated_role=role, kv_transfer_timeout_s=8, **opts).engine
    devices = sorted(d.id for d in engine.engine.runner.k_cache.devices())

    if role == "prefill":
        held_pages = {}
        real_read = engine.sender.read_pages
        def read_pages(pages):
            if list(pages[:len(held_pages.get("r2", []))]) == held_pages.get("r2"):
                raise RuntimeError("injected: reading the pages failed")
            return real_read(pages)
        engine.sender.read_pages = read_pages
        for i, rid in enumerate(ids):
            if rid not in DIRECT:
                engine.add_request(rid, None, dataclasses.replace(params[i], kv_transfer_params={"do_remote_decode": True}),
                                   prompt_token_ids=prompts[i])
        deadline = time.time() + 150
        while time.time() < deadline and not (get("done") and not engine.sender.held):
            for o in (engine.step() if engine.has_unfinished_requests() else []):
                if o.finished:
                    kv = o.kv_transfer_params
                    if kv["transfer_id"] is not None:
                        held_pages[o.request_id] = engine.sender.held[kv["transfer_id"]][0]
                    put(f"kv/{o.request_id}", kv)
            if not engine.has_unfinished_requests():
                time.sleep(0.01)
        result = dict(used=engine.engine.block_manager.num_used_pages, held=len(engine.sender.held),
                      sent=engine.sender.num_sent, not_sent=engine.sender.num_not_sent, devices=devices,
                      first_token_final=get("kv/r3"))
    else:
        class FailingReadiness:  # a copy whose failure shows only when it is polled
            def is_ready(self):
                raise RuntimeError("injected: the copy failed on the device")
        real_start = engine.receiver.start
        engine.receiver.start = lambda h: (real_start(h), FailingReadiness()) if h.request_id == "r1" else real_start(h)
        for i, rid in enumerate(ids):
            if rid in DIRECT:
                engine.add_request(rid, None, params[i], prompt_token_ids=prompts[i])
        pending = [r for r in handed if r != LOST]
        got, aborted, deltas = {}, None, {}
        deadline = time.time() + 150
        while time.time() < deadline and (pending or engine.has_unfinished_requests()):
            for rid in list(pending):
                kv = get(f"kv/{rid}")
                if kv is not None:
                    if rid == BOGUS:
                        kv["transfer_id"] = "never-held"
                    i = ids.index(rid)
                    engine.add_request(rid, None, dataclasses.replace(params[i], kv_transfer_params=kv),
                                       prompt_token_ids=prompts[i])
                    pending.remove(rid)
            for o in engine.step():
                for c in o.outputs:
                    deltas.setdefault(o.request_id, {}).setdefault(c.index, []).extend(c.token_ids_delta)
                if o.finished:
                    got[o.request_id] = [[c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]]
            if aborted is None and any(h.request_id == "r7" for h in engine.half.moving):
                before = engine.engine.block_manager.num_used_pages
                out = engine.abort_request("r7")
                aborted = dict(reason=out.outputs[0].finish_reason, tokens=out.outputs[0].token_ids,
                               freed=before - engine.engine.block_manager.num_used_pages)
        put("done", 1)
        s = engine.stats()
        streamed = {rid: [d[i] for i in sorted(d)] for rid, d in deltas.items() if rid in got}
        result = dict(want=want, got=got, streamed=streamed, aborted=aborted, used=engine.engine.block_manager.num_used_pages,
                      received=s.kv_transfers_received, failed=s.kv_transfers_failed, devices=devices,
                      pending=pending, transfers=engine.half.num_transfers)
    print("RESULT" + json.dumps(result), flush=True)
""")


def test_prefill_and_decode_processes_give_the_single_engine_tokens(tiny_model, tmp_path):
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=1024)
    env = simulated_env(2)
    port = free_port()
    procs = {role: subprocess.Popen([sys.executable, "-c", SCRIPT, role, str(port), model], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for role in ("prefill", "decode")}
    out = {}
    for role, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            stdout, stderr = proc.communicate()
        line = next((l for l in stdout.splitlines() if l.startswith("RESULT")), None)
        assert line is not None, f"{role} process gave no result (exit {proc.returncode}):\n{stderr[-4000:]}"
        out[role] = json.loads(line[len("RESULT"):])
    pre, dec = out["prefill"], out["decode"]
    assert len(pre["devices"]) == len(dec["devices"]) == 2 and not set(pre["devices"]) & set(dec["devices"])
    want, got = dec["want"], dec["got"]
    assert not dec["pending"] and set(got) == set(want) - {"r7"}
    for rid in got:  # tokens, and logprobs (r2, recomputed after a failed read), exactly as one engine gives them
        assert got[rid][0] == want[rid][0], rid
    assert got["r2"][1] == want["r2"][1]
    assert dec["streamed"] == {rid: got[rid][0] for rid in got}  # a stream hands out every token once, the first too
    assert [len(t) for t in got["r4"][0]] == [6, 6]
    # r3's first token ended it on the prefill side: nothing to move, the decode side only emits it
    assert pre["first_token_final"]["transfer_id"] is None and got["r3"][0] == [want["r3"][0][0]]
    # r7 was aborted while its pages were in flight: its 90-token prompt's decode pages freed at once
    assert dec["aborted"]["reason"] == "abort" and len(dec["aborted"]["tokens"]) == 1
    assert dec["aborted"]["freed"] == -(-90 // 8)
    # moved: r0, r5, r6 (r1's copy failed when polled, r2's read failed, r8's id was never held; r3 had nothing to
    # move, r4 ran on the decode side, r7 was aborted, r9 never came)
    assert dec["transfers"] == 7 and dec["received"] == 3 and dec["failed"] == 3
    assert pre["sent"] == 5 and pre["not_sent"] == 2  # r0 r1 r5 r6 r7; r2 r8
    assert pre["used"] == 0 and pre["held"] == 0 and dec["used"] == 0  # r9's hold released after the timeout


SERVE_OPTS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--page-size", "8",
              "--num-pages", "96", "--max-model-len", "256", "--log-level", "warning"]


def _used_pages(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)["jlight:kv_cache_pages_used"]


@pytest.mark.extended  # three server processes (~90 s on two cores); the two-process test above covers the engines
def test_router_over_prefill_and_decode_servers(tiny_model, tmp_path):
    """`jlight serve --disaggregated-role prefill|decode|router` as three processes on loopback: each request through
    the router gives the decode server's own answer for it alone (logprobs too), streamed or not; a client that leaves
    mid-stream frees the pages on both sides; the pages moved (kv_transfers_total)."""
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=1024)
    env = simulated_env(2)
    coordinator, ports = free_port(), {role: free_port() for role in ("prefill", "decode", "router")}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    serve = [sys.executable, "-m", "jlight.serve.cli"]
    cmds = {role: serve + [model, *SERVE_OPTS, "--disaggregated-role", role, "--coordinator-address",
                           f"127.0.0.1:{coordinator}", "--port", str(ports[role])] for role in ("prefill", "decode")}
    cmds["router"] = serve + ["--disaggregated-role", "router", "--prefill", urls["prefill"], "--decode", urls["decode"],
                              "--port", str(ports["router"]), "--log-level", "warning"]
    procs = {role: subprocess.Popen(cmd, env=env, stdout=open(tmp_path / f"{role}.log", "w"), stderr=subprocess.STDOUT)
             for role, cmd in cmds.items()}
    try:
        deadline = time.time() + 240
        while True:  # the router's /health is both servers'
            for role, p in procs.items():
                assert p.poll() is None, f"{role} exited:\n{(tmp_path / f'{role}.log').read_text()[-3000:]}"
            try:
                if httpx.get(urls["router"] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the servers did not come up"
            time.sleep(0.5)
        rng = np.random.default_rng(1)
        bodies = [{"prompt": rng.integers(3, 500, size=n).tolist(), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                  for n in (7, 60, 130)]
        bodies += [{"prompt": "hello there", "max_tokens": 6, "temperature": 0.9, "seed": 11, "ignore_eos": True},
                   {"prompt": rng.integers(3, 500, size=20).tolist(), "max_tokens": 6, "temperature": 0, "logprobs": 2,
                    "ignore_eos": True},
                   {"prompt": "abc", "max_tokens": 1, "temperature": 0},
                   {"prompt": "two samples", "max_tokens": 5, "n": 2, "temperature": 0.7, "seed": 2}]
        with httpx.Client(timeout=120) as client:
            def ask(url, body):
                r = client.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return [(c["text"], c["logprobs"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            want = [ask(urls["decode"], b) for b in bodies]  # the decode server alone: one engine's answers
            assert [ask(urls["router"], b) for b in bodies] == want
            streamed = []
            with client.stream("POST", urls["router"] + "/v1/completions", json={**bodies[1], "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[6:])["choices"][0]["text"])
            assert "".join(streamed) == want[1][0][0]
            # a client that leaves after the first chunk: both servers free the request's pages
            long_body = {**bodies[1], "max_tokens": 150, "stream": True}
            with client.stream("POST", urls["router"] + "/v1/completions", json=long_body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
        deadline = time.time() + 20
        while (_used_pages(urls["prefill"]), _used_pages(urls["decode"])) != (0, 0):
            assert time.time() < deadline, "pages still held after the client left"
            time.sleep(0.2)
        pre, dec = (parse_metrics(httpx.get(urls[r] + "/metrics").text) for r in ("prefill", "decode"))
        moved = 5 + 2  # five handed-on requests with pages (not r5, whose first token ends it, nor n=2), the stream, the leaver
        assert dec['jlight:kv_transfers_total{outcome="received"}'] == moved and pre['jlight:kv_transfers_total{outcome="sent"}'] == moved
        assert dec['jlight:kv_transfers_total{outcome="failed"}'] == 0
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
