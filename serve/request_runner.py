"""Runs the engine requests behind one HTTP request and keeps their books.

One HTTP request becomes one engine request per prompt (a completions request may batch
prompts). `RequestRunner.run` merges their outputs into one stream, records latency
metrics, holds the admission slot that backpressure counts, and aborts every engine
request still running when the consumer stops early (client disconnect, task cancel),
so its KV pages are freed at once. It keeps the open engine requests, which a drain's
deadline aborts (`abort_open`): their outputs then end with finish_reason "abort".
An engine failure becomes a 500 naming the engine request.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator

from jlight.core.errors import EngineOverloadedError
from jlight.engine.async_engine import RequestFailedError
from jlight.engine.outputs import RequestOutput
from jlight.engine.sampling_params import SamplingParams
from jlight.serve.drain import RETRY_AFTER_S, Drain
from jlight.serve.errors import RequestError
from jlight.serve.metrics import ServerMetrics
from jlight.serve.validation import engine_error

@dataclasses.dataclass
class EngineJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    structured_param: str | None = None  # the request field behind params.structured_outputs, for errors


class Admission:
    """Counts requests admitted but not yet producing tokens (waiting, in the server's
    view, which includes those not yet handed to the engine); refuses past the limit."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.waiting = 0

    @contextlib.contextmanager
    def slot(self, num_jobs: int):
        if self.waiting + num_jobs > self.max_waiting:
            raise overloaded()
        self.waiting += num_jobs
        released = [False]

        def release():
            if not released[0]:
                released[0] = True
                self.waiting -= num_jobs
        try:
            yield release
        finally:
            release()


def overloaded() -> RequestError:
    return RequestError("the server is overloaded: too many requests are waiting; retry later",
                        status=503, type_="server_overloaded", code="overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def draining() -> RequestError:
    return RequestError("the server is shutting down; retry on another replica", status=503,
                        type_="server_unavailable", code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})


class _Timing:
    """Per engine request: feeds TTFT, inter-token and end-to-end latency histograms."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival, self.last = metrics, arrival, None

    def on_output(self, now: float) -> None:
        if self.last is None:
            self.metrics.record_first_token(now - self.arrival)
        else:
            self.metrics.record_inter_token(now - self.last)
        self.last = now


def _outcome(out: RequestOutput) -> str:
    reasons = {c.finish_reason for c in out.outputs}
    if "abort" in reasons:
        return "abort"
    if "error" in reasons:  # a structured-output constraint no token could meet
        return "error"
    return "length" if reasons == {"length"} else "stop"


class RequestRunner:
    def __init__(self, async_llm, metrics: ServerMetrics, admission: Admission, drain: Drain):
        self.async_llm, self.metrics, self.admission, self.drain = async_llm, metrics, admission, drain
        self.open: dict[str, EngineJob] = {}  # engine request id -> job, for every job not yet finished
        drain.abort_open = self.abort_open

    def abort_open(self) -> int:
        """Abort every open engine request (the drain's deadline); returns how many."""
        for request_id in self.open:
            self.async_llm.abort(request_id)
        return len(self.open)

    async def run(self, jobs: list[EngineJob]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (job index, RequestOutput) as outputs arrive, until every job finished.
        Raises RequestError (503) when overloaded or past a drain's deadline, before anything is
        yielded, and (500) when the engine fails a job."""
        if self.drain.deadline_passed:
            raise draining()
        arrival = time.perf_counter()
        timings = [_Timing(self.metrics, arrival) for _ in jobs]
        finished = [False] * len(jobs)
        with self.admission.slot(len(jobs)) as release:
            self.open.update((job.request_id, job) for job in jobs)
            try:
                async with contextlib.aclosing(self._merged(jobs)) as merged:
                    async for index, out in merged:
                        release()  # the first output means the engine has taken the request on
                        now = time.perf_counter()
                        if any(c.token_ids_delta for c in out.outputs) or out.finished:
                            timings[index].on_output(now)
                        if out.finished and not finished[index]:
                            finished[index] = True
                            self.open.pop(jobs[index].request_id, None)
                            self.metrics.record_finished(_outcome(out), now - arrival)
                        elif self.drain.deadline_passed:
                            # Handed to the engine after the deadline's aborts reached it: abort it now.
                            self.async_llm.abort(jobs[index].request_id)
                        yield index, out
            except RequestFailedError as e:  # the engine failed (a step raised): not the client's doing
                self._abort_unfinished(jobs, finished, "error")
                raise RequestError(str(e), status=500, type_="internal_error", code="engine_error") from None
            except EngineOverloadedError:
                finished[:] = [True] * len(jobs)  # the engine never took them
                self.metrics.record_finished("overloaded")
                raise overloaded() from None
            except ValueError as e:  # the engine's own checks: the grammar compiles there; ours run first otherwise
                finished[:] = [True] * len(jobs)
                self.metrics.record_finished("invalid")
                raise engine_error(e, jobs[0].structured_param) from None
            except (asyncio.CancelledError, GeneratorExit):
                self._abort_unfinished(jobs, finished, "client_disconnect")
                raise
            except BaseException:
                self._abort_unfinished(jobs, finished, "error")
                raise
            finally:
                # A consumer that stopped iterating early without an exception reaching us.
                self._abort_unfinished(jobs, finished, "client_disconnect")
                for job in jobs:
                    self.open.pop(job.request_id, None)

    def _abort_unfinished(self, jobs, finished, outcome: str) -> None:
        for job, done in zip(jobs, finished):
            if not done:
                self.async_llm.abort(job.request_id)
                self.metrics.record_finished(outcome)
        finished[:] = [True] * len(finished)

    async def _merged(self, jobs: list[EngineJob]):
        if len(jobs) == 1:  # the common case needs no tasks or queue
            job = jobs[0]
            stream = self.async_llm.generate(job.prompt_token_ids, job.params, job.request_id)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    yield 0, out
            return
        # Several prompts: one task per engine request feeding a shared queue.
        queue: asyncio.Queue = asyncio.Queue()
        done_marker = object()

        async def pump(index: int, job: EngineJob):
            stream = self.async_llm.generate(job.prompt_token_ids, job.params, job.request_id)
            try:
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        await queue.put((index, out))
                await queue.put((index, done_marker))
            except BaseException as e:  # hand the failure to the consumer
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
        try:
            remaining = len(jobs)
            while remaining:
                index, item = await queue.get()
                if item is done_marker:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
