"""The router of disaggregated serving (`jlight serve --disaggregated-role router`): an OpenAI-compatible front that
sends each request through a prefill server and then a decode server (vLLM's disaggregated proxy, SGLang's PD
router), and answers with the decode server's response, streamed as it comes.

For a request that can be handed on (one prompt, n=1, no echo or prompt logprobs), the router:
  1. posts it to the prefill server, not streaming, with kv_transfer_params {"do_remote_decode": true}: the prefill
     process computes the prompt and the first token and holds the prompt's K/V for the decode process
     (jlight/engine/disaggregated_roles.py); its answer carries kv_transfer_params saying where they are;
  2. posts the client's own body to the decode server with those kv_transfer_params and relays its response.
Invariants: the client's body is relayed as it came (only kv_transfer_params, and for the prefill stream=false, are
set); a prefill that fails (5xx, unreachable, no kv_transfer_params) loses nothing: the request goes to the decode
server alone, which computes it whole; a prefill's 4xx is the client's answer (the decode server would say the
same); a client that leaves closes the upstream request it was waiting on, so that server aborts it and frees its
pages. Other requests, and bodies that are not JSON objects, go to the decode server as they are.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from jlight.serve.handlers import CLIENT_CLOSED_REQUEST, ClientGone, ClosingStreamingResponse, until_disconnect
from jlight.serve.response_models import error_body
from jlight.serve.defaults import CLIENT_KEEPALIVE_EXPIRY_S

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def handed_on(path: str, body) -> bool:
    """Whether a request goes through the prefill server: one prompt, one sample, no prompt logprobs."""
    if not isinstance(body, dict) or body.get("n", 1) not in (1, None) or body.get("best_of") not in (1, None):
        return False
    if path == "/v1/completions":
        prompt = body.get("prompt")
        one_prompt = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
        return bool(one_prompt) and not body.get("echo") and body.get("prompt_logprobs") is None
    return True


class Router:
    def __init__(self, prefill_url: str, decode_url: str, client: httpx.AsyncClient):
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.client = client
        self.num_handed_on = self.num_decode_only = self.num_prefill_failures = 0

    async def generate(self, path: str, request: Request) -> Response:
        raw = await request.body()
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            body = json.loads(raw) if len(raw) < (1 << 20) else await asyncio.to_thread(json.loads, raw)
        except ValueError:
            body = None  # the decode server answers the 400
        try:
            if not handed_on(path, body):
                self.num_decode_only += 1
                return await until_disconnect(request, self._relay(path, raw, auth))
            prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
            prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
            answer = await until_disconnect(request, self._prefill(path, prefill_body, auth))
            if isinstance(answer, Response):
                return answer  # the client's own error
            if answer is None:  # the prefill failed: the decode server computes the request whole
                self.num_prefill_failures += 1
                return await until_disconnect(request, self._relay(path, raw, auth))
            self.num_handed_on += 1
            content = json.dumps({**body, "kv_transfer_params": answer}).encode()
            return await until_disconnect(request, self._relay(path, content, auth))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _prefill(self, path: str, body: dict, auth: dict):
        """The prefill server's kv_transfer_params; a Response for a 4xx; None when it failed."""
        try:
            r = await self.client.post(self.prefill_url + path, json=body, headers=auth)
        except httpx.HTTPError as e:
            logger.warning("prefill server %s failed (%s); the decode server computes the request", self.prefill_url, e)
            return None
        if 400 <= r.status_code < 500:
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code != 200:
            logger.warning("prefill server answered %d; the decode server computes the request", r.status_code)
            return None
        return r.json().get("kv_transfer_params")

    async def _relay(self, path: str, content: bytes, auth: dict) -> Response:
        """The decode server's response to `content`, its body streamed through as it comes."""
        request = self.client.build_request("POST", self.decode_url + path, content=content,
                                            headers={"content-type": "application/json", **auth})
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse(error_body(f"the decode server {self.decode_url} cannot be reached: {e}",
                                           "server_unavailable"), status_code=502)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # a client that leaves closes the upstream request: the decode server aborts it
                await upstream.aclose()
        return ClosingStreamingResponse(body(), status_code=upstream.status_code, headers=headers)

    async def health(self) -> tuple[bool, str]:
        for name, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                r = await self.client.get(url + "/health", timeout=5)
            except httpx.HTTPError as e:
                return False, f"{name} server {url}: {e}"
            if r.status_code != 200:
                return False, f"{name} server {url}: {r.status_code} {r.text[:200]}"
        return True, "ok"


def build_router_app(prefill_url: str, decode_url: str, client: httpx.AsyncClient | None = None) -> FastAPI:
    """client: the HTTP client to both servers (a new one, without timeouts on reading streams, by default)."""
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), limits=httpx.Limits(
        max_connections=None, keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S))
    router = Router(prefill_url, decode_url, client)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="jlight disaggregated router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        r = await client.get(router.decode_url + "/v1/models", headers=auth)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        ok, why = await router.health()
        return PlainTextResponse(why, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("".join(f"jlight_router_requests_total{{route=\"{route}\"}} {n}\n" for route, n in (
            ("handed_on", router.num_handed_on), ("decode_only", router.num_decode_only),
            ("prefill_failed", router.num_prefill_failures))), media_type="text/plain; version=0.0.4")

    return app
