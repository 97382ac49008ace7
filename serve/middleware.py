"""The guard in front of every route: API key, drain, body size limit, UTF-8 check.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would wrap streaming
responses and hide client disconnects from them). It reads a request body in full, up to
the limit, before the route sees it, so an oversized upload is refused without being
parsed; the body is then replayed to the route, and later `receive()` calls (the route
listening for a disconnect) go to the client connection again. While the server drains
(serve/drain.py) a new POST gets 503 with Retry-After; the POSTs it lets through are
counted in flight until answered.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.responses import JSONResponse

from jlight.serve.drain import RETRY_AFTER_S, Drain
from jlight.serve.response_models import error_body

logger = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = ("/health",)


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, drain: Drain):
        self.app, self.max_body_bytes, self.drain = app, max_body_bytes, drain
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # header names arrive lower-cased
        if self.api_key is not None and scope["path"] not in UNAUTHENTICATED_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            # The scheme is case-insensitive ("bearer" is common); the key is compared in constant time.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                return await _error(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                    "authentication_error", code="invalid_api_key",
                                    headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await _error(503, "the server is shutting down; retry on another replica", "server_unavailable",
                                code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
        with self.drain.request():
            try:
                await self._guarded(scope, receive, send, headers)
            except asyncio.CancelledError:
                if not self.drain.draining:
                    raise
                # uvicorn cancels what is left once the drain is over: a response its client did not read.
                logger.warning("%s %s: response cut at shutdown (its client did not read it)", scope["method"], scope["path"])

    async def _guarded(self, scope, receive, send, headers):
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body; nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _error(400, f"request body is not valid UTF-8 (byte {e.start}); encode JSON as UTF-8",
                                "invalid_request_error")(scope, receive, send)

        replayed = False

        async def replay_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, send)

    async def _too_large(self, scope, receive, send):
        await _error(413, f"request body is larger than the server's limit of {self.max_body_bytes} bytes; "
                          f"send a smaller request (or start the server with a larger --max-body-bytes)",
                     "invalid_request_error", code="request_too_large")(scope, receive, send)
