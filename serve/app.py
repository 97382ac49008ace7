"""build_app: the FastAPI application around an AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text), POST /tokenize, POST /detokenize. Every error a client can
cause is a 4xx with OpenAI's body {"error": {"message", "type", "param", "code"}}.

The POST routes parse their own bodies, in the host pool (serve/host_work.py), so FastAPI does
not parse them on the event loop; `_openapi` puts the request models back into the schema.
`app.state.drain` is the server's Drain (serve/drain.py), which `jlight serve` starts on SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re

import pydantic.json_schema
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from jlight.serve.budget import PromptBudget, longest_token_bytes
from jlight.serve.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_SHUTDOWN_TIMEOUT_S
from jlight.serve.drain import Drain
from jlight.serve.errors import RequestError
from jlight.serve.handlers import GenerationHandlers
from jlight.serve.host_work import HostWork, parse_body
from jlight.serve.metrics import ServerMetrics
from jlight.serve.middleware import GuardMiddleware
from jlight.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jlight.serve.request_runner import Admission, RequestRunner
from jlight.serve.response_models import ErrorResponse, ModelCard, ModelList, error_body
from jlight.serve.validation import chat_prompt, check_model_name

logger = logging.getLogger(__name__)

PYDANTIC_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}
# Each POST route's request body, as the OpenAPI schema shows it.
BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
               "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _body_schema(path: str) -> dict:
    schema = {"$ref": f"#/components/schemas/{BODY_MODELS[path].__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema with the request models its routes do not declare (they parse their own bodies)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = pydantic.json_schema.models_json_schema([(m, "validation") for m in BODY_MODELS.values()],
                                                          ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


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
              served_model_names: list[str] | None = None, tool_call_parser: str | None = None,
              host: HostWork | None = None, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> FastAPI:
    """tool_call_parser: a serve/tool_parsers.py format ("hermes", "llama3_json", "mistral"); with it tool_choice "auto"
    is answered. host: the pool for host work (a new one, one worker per core, by default); AsyncLLM's
    `executor` should be its pool. shutdown_timeout_s: the drain's deadline."""
    served_names = list(served_model_names or [async_llm.model_name])
    host = host or HostWork()
    tokenizer = async_llm.tokenizer
    budget = PromptBudget(async_llm.max_model_len, longest_token_bytes(tokenizer) if tokenizer is not None else None)
    metrics = ServerMetrics()
    drain = Drain(shutdown_timeout_s)
    runner = RequestRunner(async_llm, metrics, Admission(max_waiting_requests), drain)
    handlers = GenerationHandlers(async_llm, runner, served_names, host, budget, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        drain.bind(asyncio.get_running_loop())
        yield
        async_llm.shutdown()  # after the drain
        host.close()

    app = FastAPI(title="jlight OpenAI-compatible server", lifespan=lifespan)
    app.openapi = lambda: _openapi(app)
    app.state.metrics, app.state.drain = metrics, drain
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, drain=drain)

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

    @app.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=_body_schema("/v1/completions"))
    async def completions(request: Request):
        return await handlers.completions(request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=_body_schema("/v1/chat/completions"))
    async def chat_completions(request: Request):
        return await handlers.chat(request)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=name, max_model_len=async_llm.max_model_len) for name in served_names])

    @app.get("/health")
    async def health():
        if async_llm.error is not None:  # the engine loop is gone: take this server out of rotation
            return PlainTextResponse(f"engine stopped: {async_llm.error}", status_code=503)
        if drain.draining:
            return PlainTextResponse("draining", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(async_llm.stats()), media_type="text/plain; version=0.0.4")

    def tokenized(body: TokenizeRequest) -> bytes:  # in the host pool: the ids and their JSON grow with the text
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            ids = chat_prompt(body.messages, tokenizer, body.add_generation_prompt, tools)
        else:
            try:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except UnicodeEncodeError:
                raise RequestError("prompt contains invalid Unicode (a lone surrogate escape)", param="prompt") from None
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": async_llm.max_model_len}).encode()

    @app.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=_body_schema("/tokenize"))
    async def tokenize(request: Request):
        body = await host.run(parse_body, TokenizeRequest, await request.body(), budget.chat_shape)
        check_model_name(body.model, served_names)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of prompt or messages", param="prompt")
        if body.tools is not None and body.messages is None:
            raise RequestError("tools go with messages (a chat prompt); send messages, or leave tools out",
                               param="tools")
        return Response(await host.run(tokenized, body), media_type="application/json")

    def detokenized(tokens: list[int]) -> str:  # in the host pool
        vocab = async_llm.model_config.vocab_size
        bad = next((t for t in tokens if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return tokenizer.decode(tokens, skip_special_tokens=False)

    @app.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=_body_schema("/detokenize"))
    async def detokenize(request: Request):
        body = await host.run(parse_body, DetokenizeRequest, await request.body(), budget.detokenize_shape)
        check_model_name(body.model, served_names)
        return {"prompt": await host.run(detokenized, body.tokens)}

    return app
