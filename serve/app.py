"""build_app: the FastAPI application around an AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text), POST /tokenize, POST /detokenize. Every error a client can
cause is a 4xx with OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import contextlib
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from jlight.serve.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from jlight.serve.errors import RequestError
from jlight.serve.handlers import GenerationHandlers
from jlight.serve.metrics import ServerMetrics
from jlight.serve.middleware import GuardMiddleware
from jlight.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jlight.serve.request_runner import Admission, RequestRunner
from jlight.serve.response_models import ErrorResponse, ModelCard, ModelList, error_body
from jlight.serve.validation import chat_prompt, check_model_name

logger = logging.getLogger(__name__)

PYDANTIC_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's error list -> one OpenAI error naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    # Union members add a type tag to the path ("prompt", "list[str]", 0); keep field names and indices.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    loc = [part for part in loc if re.fullmatch(r"\d+|[a-z_][a-z0-9_]*", part) and part not in PYDANTIC_TYPE_TAGS]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message, param = f"request body is not valid JSON: {first.get('msg', '')}", None
    elif first.get("type") == "value_error" and first.get("ctx", {}).get("error"):
        message = str(first["ctx"]["error"])  # our own validators' messages name the field already
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if "input" in first and param:
            message += f" (got {str(first['input'])[:100]!r})"
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


def build_app(async_llm, api_key: str | None = None,
              max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              served_model_names: list[str] | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """tool_call_parser: a serve/tool_parsers.py format ("hermes", "llama3_json", "mistral"); with it tool_choice "auto"
    is answered."""
    served_names = list(served_model_names or [async_llm.model_name])
    metrics = ServerMetrics()
    runner = RequestRunner(async_llm, metrics, Admission(max_waiting_requests))
    handlers = GenerationHandlers(async_llm, runner, served_names, tool_call_parser)
    tokenizer = async_llm.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        async_llm.shutdown()  # after uvicorn drained the in-flight requests

    app = FastAPI(title="jlight OpenAI-compatible server", lifespan=lifespan)
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        if exc.status >= 500:
            logger.warning("%s: %s", request.url.path, exc.message)
        else:
            metrics.record_finished("invalid")
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        metrics.record_finished("invalid")
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        metrics.record_finished("error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await handlers.completions(body, request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handlers.chat(body, request)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=name, max_model_len=async_llm.max_model_len) for name in served_names])

    @app.get("/health")
    async def health():
        if async_llm.error is not None:  # the engine loop is gone: take this server out of rotation
            return PlainTextResponse(f"engine stopped: {async_llm.error}", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(async_llm.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        check_model_name(body.model, served_names)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of prompt or messages", param="prompt")
        if body.tools is not None and body.messages is None:
            raise RequestError("tools go with messages (a chat prompt); send messages, or leave tools out",
                               param="tools")
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            ids = chat_prompt(body.messages, tokenizer, body.add_generation_prompt, tools)
        else:
            try:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except UnicodeEncodeError:
                raise RequestError("prompt contains invalid Unicode (a lone surrogate escape)", param="prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": async_llm.max_model_len}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        check_model_name(body.model, served_names)
        vocab = async_llm.model_config.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app
