"""What SIGTERM (and Ctrl-C) promise: a drain, then an exit.

- At once, readiness turns false (/health answers 503 "draining") and every new POST gets 503 with
  Retry-After. The listener stays open, so a client gets an answer, not a refused connection.
- The requests already in flight run on until they finish or until the deadline (`timeout_s`,
  `jlight serve --shutdown-timeout`).
- At the deadline every engine request still open is aborted: a stream ends with a last chunk whose
  finish_reason is "abort", then `data: [DONE]`; a non-streaming request gets its whole JSON body,
  with that finish reason. A request that reaches the engine after the deadline gets a 503.
- As soon as nothing is in flight (or `grace_s` after the deadline, for responses a client does not
  read) `on_drained` stops the server. None of it logs a traceback.

`DrainingServer` is uvicorn's server with its exit signals turned into `Drain.begin`; a second
Ctrl-C exits at once, as uvicorn's does.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Callable

import uvicorn

logger = logging.getLogger(__name__)

GRACE_S = 5.0  # after the deadline: time for clients to read their responses' last chunks
RETRY_AFTER_S = 1


class Drain:
    def __init__(self, timeout_s: float, grace_s: float = GRACE_S):
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.draining = False  # readiness false; new POSTs get 503
        self.deadline_passed = False  # open requests were aborted; none is admitted any more
        self.in_flight = 0  # POST requests being answered
        self.abort_open: Callable[[], int] = lambda: 0  # aborts every open engine request, returns how many
        self.on_drained: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server runs on (lifespan start-up), for begin_threadsafe."""
        self._loop = loop

    @property
    def bound(self) -> bool:
        return self._loop is not None

    def begin_threadsafe(self) -> None:
        """From a signal handler or another thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin)

    def begin(self) -> None:
        if self.draining:
            return
        self.draining = True
        logger.info("draining: /health answers 503, new requests get 503; %d in flight have %.0f s to finish",
                    self.in_flight, self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    @contextlib.contextmanager
    def request(self):
        """Counts one request in flight (the guard middleware, around each POST)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._changed.set()

    async def _idle_within(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.in_flight:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, end - loop.time()))
            except asyncio.TimeoutError:
                return self.in_flight == 0
        return True

    async def _run(self) -> None:
        if not await self._idle_within(self.timeout_s):
            self.deadline_passed = True
            aborted = self.abort_open()
            logger.info("drain deadline (%.0f s): %d engine requests aborted, their responses end with "
                        "finish_reason abort", self.timeout_s, aborted)
            if not await self._idle_within(self.grace_s):
                logger.warning("%d responses still unread %.0f s after the drain deadline are cut",
                               self.in_flight, self.grace_s)
        logger.info("drained; shutting down")
        self.on_drained()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT start `drain` instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.on_drained = self._drained

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if (self.drain.draining and sig == signal.SIGINT) or not self.drain.bound:
            super().handle_exit(sig, frame)  # a second Ctrl-C, or a signal before start-up: exit now
            return
        self.drain.begin_threadsafe()
