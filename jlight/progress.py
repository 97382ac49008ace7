"""What jlight tells a person while it works: a progress bar on a terminal, one line elsewhere.

A progress bar redraws itself with carriage returns, and a file or a pipe keeps every redraw, so a
log of one model load held hundreds of them. `Progress` therefore draws a tqdm bar only when its
stream (stderr) is a terminal; anywhere else it only counts, and when it closes it logs one summary
line ("loaded 272 tensors in 2.1 s"). The start-up phases (load, compile, ready) are log lines of
the `jlight` logger at INFO; `log_to_stderr` is how the command line shows them ("jlight: ...").
"""
from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("jlight")


def on_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """A bar of `total` steps on a terminal; elsewhere a counter whose close logs `summary`.

    summary: a format string over n (steps done), total, unit and seconds, e.g.
    "loaded {n} {unit}s in {seconds:.1f} s"; None logs nothing at close (the caller says it)."""

    def __init__(self, total: int, desc: str, unit: str, *, summary: str | None = None, initial: int = 0,
                 stream=None, leave: bool = False):
        self.total, self.unit, self.summary = total, unit, summary
        self.n = initial
        self._start = time.perf_counter()
        self._bar = None
        if on_terminal(stream):
            # tqdm loads only when a bar is drawn.
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, dynamic_ncols=True,
                             file=stream if stream is not None else sys.stderr)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values) -> None:
        if self._bar is not None:
            self._bar.set_postfix(refresh=False, **values)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.summary is not None:
            logger.info(self.summary.format(n=self.n, total=self.total, unit=self.unit, seconds=self.seconds))
            self.summary = None  # once

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iterate(items, total: int, desc: str, unit: str, summary: str | None = None):
    """Yield items while a Progress counts them (closed when the iteration ends or stops)."""
    with Progress(total, desc, unit, summary=summary) as bar:
        for item in items:
            yield item
            bar.update()


def log_to_stderr(level: int = logging.INFO) -> None:
    """Print the `jlight` logger's lines at `level` and above on stderr as "jlight: message" (the CLI's
    own commands; a program embedding jlight configures logging itself). Idempotent."""
    if any(getattr(h, "_jlight_cli", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jlight: %(message)s"))
    handler._jlight_cli = True
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
