"""The host work of a request, off the event loop: parsing its body, chat templating, tokenizing,
detokenizing long token lists, building a whole response.

Invariants:
- The event loop runs no work whose cost grows with the request: it awaits `HostWork.run`, which
  runs the function in a thread pool of one worker per core this process may use. The expensive
  parts release the GIL (tokenizers' batch calls; see jlight/tokenizer.py) or are Python, which
  yields it every switch interval, so the loop keeps answering (/health, /metrics, other streams)
  while a worker prepares a huge request.
- A body is parsed as JSON, then checked for size (`budget.check_shape`: counts and lengths, before
  any per-item work), then validated by its pydantic model, all in the pool.
- The pool outlives no server: `close` waits for nothing and drops queued work.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
from typing import Callable, TypeVar

import pydantic
from fastapi.exceptions import RequestValidationError

from jlight.serve.errors import RequestError

T = TypeVar("T")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


class HostWork:
    def __init__(self, num_workers: int | None = None):
        self.num_workers = num_workers or host_cores()
        self.pool = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="jlight-host")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a worker; its exceptions reach the caller."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def parse_body(model: type[pydantic.BaseModel], raw: bytes, check_shape: Callable[[object], None] | None = None):
    """A request body -> `model`. Not JSON: a 400; `check_shape(data)` raises RequestError for a body too
    large to serve; pydantic's complaints become FastAPI's RequestValidationError (app.py names the field)."""
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if check_shape is not None:
        check_shape(data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
