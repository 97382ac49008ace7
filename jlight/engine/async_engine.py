"""AsyncLLM: the engine in a background thread, with an asyncio interface for the server.

HTTP handlers never block on the engine: `generate` validates and tokenizes in a worker thread
(`executor`), then hands the request over through a queue; the engine thread applies queued adds
and aborts between steps and pushes each step's outputs back onto the handlers' event loop.

Invariants:
- A stream's outputs carry only what no output before them carried: the engine builds them as deltas
  (output_kind "delta": `text`, `token_ids` and logprobs are the new part's, as in `text_delta` and
  `token_ids_delta`), and the logprobs travel packed (`stream_output`). So neither the engine nor a
  stream ever copies what it already handed on, and a consumer that wants the whole answer joins the
  outputs (`join_outputs`, or `merge_outputs` as they come).
- A stream holds at most one unread output (`_Mailbox`): an output that arrives while the one
  before is unread is merged into it (their parts joined, the rest the newer one's), so a consumer
  that reads slowly costs its unread tokens, packed, and never holds the engine back.
- Aborting a request ends its stream with the engine's last output for it, finish_reason "abort".
  Leaving the `generate` iterator early (client disconnect, cancellation) aborts the request and
  frees its pages.
- A step that raises fails the requests the engine held, each with a RequestFailedError naming
  it, and the loop goes on; three failures in a row stop it (`error`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import uuid
from typing import AsyncIterator

from jlight.core.errors import EngineOverloadedError
from jlight.engine.outputs import CompletionOutput, PackedLogprobs, RequestOutput
from jlight.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine failed while it held this request (a step raised, or the loop stopped); the request
    was aborted. Not the caller's fault: the server answers 500 naming the request."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id} failed in the engine ({reason}); it was aborted")
        self.request_id = request_id


def stream_output(out: RequestOutput) -> RequestOutput:
    """The engine's delta output as a stream carries it: each sample's logprobs (its new tokens') packed."""
    if all(c.logprobs is None for c in out.outputs):
        return out

    def pack(c: CompletionOutput) -> CompletionOutput:
        return c if c.logprobs is None else dataclasses.replace(c, logprobs=PackedLogprobs(c.logprobs))
    return dataclasses.replace(out, outputs=[pack(c) for c in out.outputs])


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` with `older`'s parts in front of its own (text, token ids, logprobs; the deltas alike): what
    a consumer that missed `older` needs, or the whole answer so far when `older` is the merge of every
    output before. Both are stream outputs (delta outputs, stream_output); `older`'s token ids and logprobs
    are extended in place (the caller owns `older` and drops it), so a long run of merges copies each entry
    once."""
    old_by_index = {c.index: c for c in older.outputs}

    def merged(c: CompletionOutput) -> CompletionOutput:
        old = old_by_index.get(c.index)
        if old is None:
            return c
        logprobs = c.logprobs
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs.extend(c.logprobs)
            logprobs = old.logprobs
        old.token_ids.extend(c.token_ids)
        text = old.text + c.text
        return dataclasses.replace(c, text=text, token_ids=old.token_ids, text_delta=text,
                                   token_ids_delta=old.token_ids, logprobs=logprobs)
    return dataclasses.replace(newer, outputs=[merged(c) for c in newer.outputs])


def join_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """A stream's outputs, in order, joined into the whole answer: the last one with every output's text,
    token ids and logprobs, each sample's text joined once (pairwise merges would copy a long answer's
    text once an output)."""
    parts: dict[int, list[CompletionOutput]] = {}
    for out in outs:
        for c in out.outputs:
            parts.setdefault(c.index, []).append(c)

    def joined(c: CompletionOutput) -> CompletionOutput:
        cs = parts[c.index]
        text, ids = "".join(p.text for p in cs), [t for p in cs for t in p.token_ids]
        logprobs = None
        if c.logprobs is not None:
            logprobs = PackedLogprobs()
            for p in cs:
                logprobs.extend(p.logprobs or ())
        return dataclasses.replace(c, text=text, token_ids=ids, text_delta=text, token_ids_delta=ids, logprobs=logprobs)
    return dataclasses.replace(outs[-1], outputs=[joined(c) for c in outs[-1].outputs])


class _Mailbox:
    """One stream's unread output (merged, see merge_outputs) and error, on the stream's event loop.
    `get` returns the output first: an error that follows it comes next."""

    def __init__(self):
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._output = item if self._output is None else merge_outputs(self._output, item)
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        if self._output is not None:
            item, self._output = self._output, None
        else:
            item, self._error = self._error, None
        if self._output is None and self._error is None:
            self._ready.clear()
        return item


class AsyncLLM:
    def __init__(self, llm, max_waiting_requests: int = 1024, executor=None):
        """executor: a concurrent.futures executor for the host work of `generate` (validation, tokenizing,
        grammar compilation); None: the event loop's default one."""
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.model_config = llm.model_config
        self.max_model_len = llm.max_model_len
        self.model_name = llm.model_name
        self.max_waiting_requests = max_waiting_requests
        self.executor = executor
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._lock = threading.Lock()  # guards _streams and _num_queued
        self._num_queued = 0  # adds handed over but not yet applied by the engine thread
        self._stats = self.engine.stats()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jlight-engine", daemon=True)
        self._thread.start()

    # ---- public ------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        if self._error is not None:
            raise RequestFailedError(request_id, f"the engine stopped after an error: {self._error}")
        if self._stopping:
            raise EngineOverloadedError("the server is shutting down; retry on another replica")
        if isinstance(prompt, str):
            validate = functools.partial(self.engine.validate_request, prompt, sampling_params)
        else:
            validate = functools.partial(self.engine.validate_request, None, sampling_params, prompt)
        # Off the event loop, which serves every other stream: tokenizing grows with the prompt, and
        # compiling a grammar takes milliseconds (the first one also builds llguidance's view of the
        # vocabulary, about a second).
        loop = asyncio.get_running_loop()
        ids, params = await loop.run_in_executor(self.executor, validate)
        params = dataclasses.replace(params, output_kind="delta")  # stream outputs: see the module's invariants
        mailbox = _Mailbox()
        with self._lock:
            if self._stats.num_waiting + self._num_queued >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self.max_waiting_requests} requests are already waiting; retry later")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (loop, mailbox)
            self._num_queued += 1
        self._commands.put(("add", request_id, prompt if isinstance(prompt, str) else None, ids, params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await mailbox.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop the request; its stream, if still read, ends with an output whose finish_reason is "abort"."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self):
        return self._stats

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped (every request now fails), or None while it runs."""
        return self._error

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, mailbox = target
            if isinstance(item, RequestOutput):
                item = stream_output(item)  # here, on the engine thread, not on the streams' loop
            try:
                loop.call_soon_threadsafe(mailbox.put, item)
            except RuntimeError:  # the handler's loop is closed: nobody listens any more
                self._commands.put(("abort", request_id))

    def _apply_commands(self) -> bool:
        """Apply queued adds/aborts. Returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "stop":
                return False
            if cmd[0] == "abort":
                final = self.engine.abort_request(cmd[1])
                if final is not None:
                    self._deliver(cmd[1], final)
                continue
            _, rid, prompt, ids, params = cmd
            with self._lock:
                self._num_queued -= 1
                listening = rid in self._streams
            if not listening:
                continue  # the client left before the engine saw the request
            try:
                self.engine.add_request(rid, prompt, params, prompt_token_ids=ids)
            except Exception as e:  # validated already; anything here goes back to that caller
                self._deliver(rid, e)

    def _step(self) -> None:
        """One engine step. A step that raises fails the requests it held, not the server; only
        repeated failures (a broken device state) stop the loop."""
        try:
            outputs = self.engine.step()
            self._consecutive_failures = 0
        except Exception as e:  # noqa: BLE001 - reported to every affected request
            self._consecutive_failures += 1
            if self._consecutive_failures >= 3:
                raise
            logger.exception("engine step failed; aborting the requests it held")
            for rid in self.engine.abort_all():
                self._deliver(rid, RequestFailedError(rid, f"an engine step raised {type(e).__name__}: {e}"))
            return
        for out in outputs:
            self._deliver(out.request_id, out)

    def _loop(self) -> None:
        self._consecutive_failures = 0
        try:
            while True:
                if not self._apply_commands():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._stats = self.engine.stats()
                else:
                    self._stats = self.engine.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # keep the reason; fail every open stream instead of hanging it
            logger.exception("engine loop crashed")
            self._error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, RequestFailedError(rid, f"the engine loop stopped: {type(e).__name__}: {e}"))
