"""The proposer interface: what the scheduler and the engine ask of a speculative proposer.

The scheduler asks `drafts(seq, max_drafts)` for each decoding sequence it lets speculate
(scheduler.py). A host proposer (ngram.py) computes them there, and with `drafts_after` it also drafts
for a sequence whose row in the step in flight is still sampling its next token, as if that row keeps
every draft it verifies (the scheduler's drafting ahead, speculative.py). A device proposer (device.py) runs
its own model after each target step (`launch`), drafts for every row that may speculate next, and
`collect` stores those drafts on the sequences when the engine reads the step back, so `drafts` only
hands them out. Both kinds propose greedily (speculative.py says why the verification stays exact).
"""
from __future__ import annotations

import abc

from jlight.engine.sequence import Sequence


class Proposer(abc.ABC):
    """A proposer that runs nothing on the device; device proposers override the device hooks."""
    # Positions past a sampling row's last token that the proposer's own step writes K/V for (the
    # scheduler reserves their pages when it can).
    lookahead = 0
    # What the target step returns for the proposer (model_runner.Taps), or None.
    taps = None
    # Whether `drafts_after` drafts for a sequence whose last token the device is still sampling.
    drafts_ahead = False

    @abc.abstractmethod
    def drafts(self, seq: Sequence, max_drafts: int) -> list[int]:
        """Up to max_drafts tokens to follow the sequence's known tokens ([] for none)."""

    def drafts_after(self, seq: Sequence, in_flight: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens for the positions after the token the device is sampling for the
        sequence, as if its known tokens went on with `in_flight` (the drafts its row in flight
        verifies, every one kept) and that token. Only for a proposer with drafts_ahead."""
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead of the device")

    def kv_bytes_per_page(self, page_size: int, kv_dtype) -> int:
        """Bytes the proposer's own K/V take per page of the target's pool (sized from the same budget), in the
        target pool's dtype kv_dtype."""
        return 0

    def attach(self, runner) -> None:
        """Set up beside the target's ModelRunner (its pages, buckets and kernels)."""

    def warmup(self, buckets) -> float:
        """Compile what `launch` runs for these step buckets. Returns the seconds spent."""
        return 0.0

    def launch(self, plan, inp, out):
        """Dispatch the drafting that follows a launched target step (plan, its host inputs, its device
        outputs); returns a handle for `collect`, or None."""
        return None

    def collect(self, plan, launched) -> None:
        """Store the drafts of a launched step on its sequences, once the engine has read the step back."""
