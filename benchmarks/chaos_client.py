"""The chaos suite's view of a server: HTTP on loopback (httpx), its /metrics, its process.

Target(base_url, ...) names the server; `await target.connect()` reads the served model and its
max_model_len from /v1/models. Stream(...) reads one SSE response and keeps every event with
its arrival time, how it ended, and any transport error (a stream cut inside a chunk).
post_in_thread sends a body from a thread (the caller's event loop keeps measuring); silent_reader
opens a connection that sends a request and never reads. ChaosFailure is the one exception a case
raises: a promise the server broke, and how.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import time
import urllib.parse

import httpx

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # jlight serve's --max-body-bytes default
CLIENT_KEEPALIVE_EXPIRY_S = 2.0  # below any server's idle keep-alive (uvicorn's default: 5 s)
RSS_METRIC = "process_resident_memory_bytes"
PY_BLOCKS_METRIC = "jlight:python_allocated_blocks"  # the server's Python allocator's share (serve/metrics.py)


class ChaosFailure(AssertionError):
    """A promise the server broke; the message says which and what was seen."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ChaosFailure(message)


@dataclasses.dataclass
class Target:
    base_url: str
    api_key: str | None = None
    server_pid: int | None = None  # for SIGTERM (a server on this machine)
    drain_timeout_s: float = 30.0  # the server's --shutdown-timeout
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # the server's --max-body-bytes
    model: str = ""
    max_model_len: int = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.AsyncClient:
        # Idle connections expire before the server's keep-alive closes them: a request sent on a connection the
        # server is closing at that moment fails with a reset (httpx's default expiry, 5 s, equals uvicorn's).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                              keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=kw.pop("timeout", 300),
                                 limits=limits, **kw)

    async def connect(self) -> "Target":
        async with self.client() as c:
            r = await c.get("/v1/models")
            check(r.status_code == 200, f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
            card = r.json()["data"][0]
            self.model, self.max_model_len = card["id"], card["max_model_len"]
        return self


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    r = await client.get("/metrics")
    check(r.status_code == 200, f"GET /metrics answered {r.status_code}")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def outcomes(m: dict[str, float]) -> dict[str, float]:
    """jlight:request_total by outcome."""
    prefix = 'jlight:request_total{outcome="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}


def outcome_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    a, b = outcomes(after), outcomes(before)
    return {k: int(a[k] - b.get(k, 0)) for k in a if a[k] != b.get(k, 0)}


async def server_rss_mb(target: Target, client: httpx.AsyncClient) -> float:
    """The server's resident memory: /proc/PID/status of a server on this machine, else /metrics."""
    if target.server_pid is not None and os.path.exists(f"/proc/{target.server_pid}/status"):
        with open(f"/proc/{target.server_pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    m = await metrics(client)
    check(RSS_METRIC in m, f"/metrics has no {RSS_METRIC} (the server reads it from /proc/self/statm)")
    return m[RSS_METRIC] / 2**20


async def wait_pool_free(client: httpx.AsyncClient, timeout_s: float) -> float:
    """Seconds until no KV page is used and no request runs or waits; a ChaosFailure after timeout_s."""
    start = time.perf_counter()
    while True:
        m = await metrics(client)
        busy = {k: m[k] for k in ("jlight:kv_cache_pages_used", "jlight:num_requests_running",
                                  "jlight:num_requests_waiting") if m.get(k)}
        if not busy:
            return time.perf_counter() - start
        check(time.perf_counter() - start < timeout_s, f"{timeout_s} s on, the engine still holds {busy}")
        await asyncio.sleep(0.02)


@dataclasses.dataclass
class Stream:
    """One streamed response: each `data:` event (text) and when it came (perf_counter seconds)."""
    status: int = 0
    events: list[str] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None  # a transport error: the stream was cut
    left: bool = False  # the client left on purpose

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks() for c in chunk.get("choices", [])
                if c.get("finish_reason")]

    def errors(self) -> list[dict]:
        return [chunk["error"] for chunk in self.chunks() if "error" in chunk]

    def max_gap(self, start: float, end: float) -> float:
        """The longest time without an event inside [start, end] (its edges count as events)."""
        inside = [start] + [t for t in self.times if start < t < end] + [end]
        return max(b - a for a, b in zip(inside, inside[1:]))

    @property
    def num_bytes(self) -> int:
        return sum(len(e) for e in self.events)

    def check_clean_end(self, what: str, reasons=("stop", "length"), choices: int = 1) -> str:
        """A stream that ended as the protocol says: each choice's finish_reason in `reasons`, then [DONE]."""
        check(self.error is None, f"{what}: the stream was cut ({self.error}) after {len(self.events)} events")
        check(self.status == 200, f"{what}: status {self.status}: {self.events[:1]}")
        check(self.done, f"{what}: no [DONE] at the end (last events: {self.events[-2:]})")
        got = self.finish_reasons()
        check(len(got) == choices and set(got) <= set(reasons),
              f"{what}: finish_reasons {got}, expected {choices} of {reasons}")
        return got[0]


async def stream(client: httpx.AsyncClient, path: str, body: dict, leave_after: int | None = None,
                 on_event=None) -> Stream:
    """POST `body` with stream=true and read the SSE events to the end (or leave after `leave_after`)."""
    s = Stream()
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.events.append((await r.aread()).decode(errors="replace"))
                return s
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    s.events.append(line[6:])
                    s.times.append(time.perf_counter())
                    if on_event is not None:
                        on_event(s)
                    if leave_after is not None and len(s.events) >= leave_after:
                        s.left = True
                        return s
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    return s


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (an exited child its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def completion(prompt, max_tokens: int, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def chat(text: str, max_tokens: int, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **fields}


async def post_in_thread(target: Target, path: str, raw: bytes) -> tuple[httpx.Response, float]:
    """POST raw bytes from a thread (this event loop keeps measuring meanwhile); (response, seconds)."""
    def post():
        start = time.perf_counter()
        r = httpx.post(target.base_url + path, content=raw, timeout=300,
                       headers={**target.headers, "Content-Type": "application/json"})
        return r, time.perf_counter() - start
    return await asyncio.to_thread(post)


def raw_request(target: Target, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    url = urllib.parse.urlsplit(target.base_url)
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(data)}"] + [f"{k}: {v}" for k, v in target.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def silent_reader(target: Target, request: bytes) -> socket.socket:
    """A connection that sends `request` and never reads (a tiny receive buffer, so the server's fills)."""
    url = urllib.parse.urlsplit(target.base_url)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (url.hostname, url.port or 80))
    await loop.sock_sendall(sock, request)
    return sock
