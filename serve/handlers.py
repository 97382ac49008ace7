"""The two generation endpoints: request -> engine jobs -> JSON or an SSE stream.

Nothing here blocks the event loop: the body is parsed, the prompt templated and tokenized and a
whole JSON response built in the host pool (serve/host_work.py), each after the size budget
(serve/budget.py) let it through; jobs go to AsyncLLM, whose loop runs in its own thread, and
outputs come back as awaitables. A request whose client goes away is aborted (see
RequestRunner), streaming or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jlight.engine.async_engine import join_outputs, merge_outputs
from jlight.serve.budget import PromptBudget
from jlight.serve.echo import Echo, prompt_texts
from jlight.serve.errors import RequestError
from jlight.serve.host_work import HostWork, parse_body
from jlight.serve.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from jlight.serve.request_runner import EngineJob, RequestRunner
from jlight.serve.response_models import error_body
from jlight.serve.responses import DONE, ResponseBuilder, TokenText, sse
from jlight.serve.validation import (chat_prompt, check_logit_bias_keys, check_model_name, completion_prompts,
                                     resolve_max_tokens, structured_outputs_param, validate_sampling_params)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client never sees it


MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n in one completions request


def _num_prompts(prompt) -> int:
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def _token_ids_only(out: RequestOutput) -> RequestOutput:
    """What a stream keeps of one of its outputs for its usage: the token ids (copied: the chunks may still read
    the output's), no text or logprobs (they went out in its chunks)."""
    return dataclasses.replace(out, outputs=[dataclasses.replace(c, text="", text_delta="", token_ids=list(c.token_ids),
                                                                 logprobs=None) for c in out.outputs])


def _json_bytes(builder: ResponseBuilder, finals) -> bytes:
    return json.dumps(builder.full_response(finals), ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


class ClientGone(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # After the body, the next ASGI message for this request is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and so aborting its engine requests) if the client
    disconnects first; then raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator when sending stops for any reason, so the engine
    requests behind a stream are aborted at once rather than when garbage-collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class GenerationHandlers:
    def __init__(self, async_llm, runner: RequestRunner, served_names: list[str], host: HostWork,
                 budget: PromptBudget, tool_call_parser: str | None = None):
        self.llm, self.runner, self.served_names = async_llm, runner, served_names
        self.host, self.budget = host, budget
        self.tool_call_parser = tool_call_parser  # None: tool_choice "auto" is a 400
        self.tokenizer = async_llm.tokenizer
        self.token_text = TokenText(self.tokenizer)  # every request's builder shares it (serve/responses.py)
        self.vocab_size = async_llm.model_config.vocab_size
        self.max_model_len = async_llm.max_model_len

    def _jobs(self, request_id: str, body, prompts: list[list[int]], max_tokens: int | None,
              prompt_param: str, max_tokens_param: str) -> list[EngineJob]:
        check_logit_bias_keys(body.logit_bias)
        if body.kv_transfer_params is not None and (len(prompts) > 1 or body.n > 1):
            raise RequestError("kv_transfer_params hands on one sequence: send one prompt with n=1",
                               param="kv_transfer_params")
        structured_param = structured_outputs_param(body)
        jobs = []
        for i, ids in enumerate(prompts):
            budget = resolve_max_tokens(max_tokens, len(ids), self.max_model_len, prompt_param, max_tokens_param)
            params = to_sampling_params(body, budget)
            validate_sampling_params(params, self.vocab_size, {"max_tokens": max_tokens_param,
                                                               "logprobs": "top_logprobs" if prompt_param == "messages" else "logprobs"},
                                     structured_param)
            jobs.append(EngineJob(f"{request_id}-{i}", ids, params, structured_param))
        return jobs

    def _completion_prompts(self, body: CompletionRequest) -> tuple[list[list[int]], list[str] | None]:
        """(each prompt's token ids, each prompt's echoed text or None); in the host pool."""
        prompts = completion_prompts(body.prompt, self.tokenizer, self.vocab_size, self.budget)
        return prompts, prompt_texts(body.prompt, prompts, self.tokenizer) if body.echo else None

    async def completions(self, request: Request) -> Response:
        body = await self.host.run(parse_body, CompletionRequest, await request.body(), self.budget.completion_shape)
        model = check_model_name(body.model, self.served_names)
        if body.best_of is not None and body.best_of != body.n:
            raise RequestError("best_of other than n is not supported (jlight does not rank samples); "
                               "leave best_of unset", param="best_of")
        if _num_prompts(body.prompt) * body.n > MAX_SEQUENCES_PER_REQUEST:
            raise RequestError(f"{_num_prompts(body.prompt)} prompts x n={body.n} asks for more than "
                               f"{MAX_SEQUENCES_PER_REQUEST} sequences in one request; lower n or split the prompts",
                               param="n")
        max_tokens, echo = body.max_tokens, None
        if max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens=0 generates nothing; it is only allowed with echo=true "
                               "(to score the prompt); ask for at least 1 token", param="max_tokens")
        prompts, texts = await self.host.run(self._completion_prompts, body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.echo:
            echo = Echo(texts, generate=max_tokens != 0)
            # The engine always samples one token; with max_tokens=0 the response leaves it out.
            max_tokens = max_tokens if echo.generate else 1
        jobs = self._jobs(request_id, body, prompts, max_tokens, "prompt", "max_tokens")
        builder = ResponseBuilder("completion", request_id, model, self.tokenizer, body.n,
                                  want_logprobs=body.logprobs is not None, num_top_logprobs=body.logprobs or 0,
                                  echo=echo, token_text=self.token_text)
        return await self._respond(request, body, jobs, builder)

    async def chat(self, request: Request) -> Response:
        body = await self.host.run(parse_body, ChatCompletionRequest, await request.body(), self.budget.chat_shape)
        model = check_model_name(body.model, self.served_names)
        if body.top_logprobs and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        # before the template: a tool_choice jlight cannot answer is a 400
        forced = body.forced_tool_call(auto_tool_choice=self.tool_call_parser is not None)
        tool_parser = self.tool_call_parser if body.parses_tool_calls() else None  # "auto": calls in free text
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        ids = await self.host.run(chat_prompt, body.messages, self.tokenizer, body.add_generation_prompt, tools,
                                  self.budget)
        max_tokens, param = body.max_tokens, "max_tokens"
        if body.max_completion_tokens is not None:
            max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = self._jobs(request_id, body, [ids], max_tokens, "messages", param)
        builder = ResponseBuilder("chat", request_id, model, self.tokenizer, body.n,
                                  want_logprobs=body.logprobs, num_top_logprobs=body.top_logprobs or 0,
                                  forced_tool_call=forced, tool_parser=tool_parser, token_text=self.token_text)
        return await self._respond(request, body, jobs, builder)

    async def _respond(self, request: Request, body, jobs: list[EngineJob], builder: ResponseBuilder) -> Response:
        # Each prompt's answer (stream outputs carry only their new part): a whole response joins its outputs
        # once they are all in; a stream keeps its token ids, merged as they come, for its usage.
        finals = [None] * len(jobs)
        outputs = self.runner.run(jobs)
        if not body.stream:
            parts = [[] for _ in jobs]

            async def collect():
                async with contextlib.aclosing(outputs):
                    async for index, out in outputs:
                        parts[index].append(out)
            try:
                await until_disconnect(request, collect())
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            finals = [join_outputs(p) if p else None for p in parts]
            return Response(await self.host.run(_json_bytes, builder, finals), media_type="application/json")

        # Wait for the first output before sending headers, so that overload and engine
        # errors still get a status code instead of a broken stream.
        try:
            first = await until_disconnect(request, outputs.__anext__())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            try:
                for chunk in builder.role_chunks(len(jobs)):
                    yield chunk
                index, out = first
                finals[index] = _token_ids_only(out)
                for chunk in builder.stream_chunks(index, out):
                    yield chunk
                async for index, out in outputs:
                    kept = _token_ids_only(out)
                    finals[index] = kept if finals[index] is None else merge_outputs(finals[index], kept)
                    for chunk in builder.stream_chunks(index, out):
                        yield chunk
                if include_usage:
                    yield builder.usage_chunk(finals)
            except RequestError as e:  # after the headers, an error can only be an event
                yield sse(error_body(e.message, e.type, e.param, e.code))
            except Exception as e:  # an engine failure mid-stream: tell the client, keep serving others
                logger.exception("stream failed")
                yield sse(error_body(f"internal error: {e}", "internal_error"))
            finally:
                await outputs.aclose()
            yield DONE

        return ClosingStreamingResponse(events(), media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache"})
