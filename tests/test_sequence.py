"""engine/sequence.py: a Sequence changes state only through its methods, and each refuses a change that
breaks an invariant (status transitions, computed tokens, page tables, pending tokens, one finish)."""
import ast
import pathlib

import numpy as np
import pytest

from jlight.core.kv_layout import NULL_PAGE
from jlight.engine.sampling_params import SamplingParams
from jlight.engine.sequence import SeqStatus, Sequence, SequenceStateError


def _seq(num_prompt=6):
    return Sequence("r", 0, list(range(10, 10 + num_prompt)), SamplingParams(), 0, 0.0)


def test_admit_launch_fetch_append_finish():
    seq = _seq()
    seq.admit([3, 4], 4, page_keys=[b"k"], state_slot=2, restore_from=5)
    assert seq.status is SeqStatus.RUNNING and seq.num_computed_tokens == 4 and seq.num_cached_tokens == 4
    assert seq.pages == [3, 4] and seq.page_keys == [b"k"] and (seq.state_slot, seq.restore_from) == (2, 5)
    seq.state_restored()
    assert seq.restore_from == 0
    seq.launched(6, row=1)  # the rest of the prompt, sampling its first token
    assert seq.num_computed_tokens == 6 and seq.num_pending_tokens == 1 and seq.last_row == 1
    assert seq.prefill_done and seq.num_tokens == 7
    seq.fetched()
    seq.append_token(99, now=1.5, logprobs={99: -0.5}, logprob=-0.5)
    assert seq.output_token_ids == [99] and seq.first_token_time == 1.5 and seq.cumulative_logprob == -0.5
    assert list(seq.token_array()) == list(range(10, 16)) + [99]
    seq.stop("stop", 99)
    with pytest.raises(SequenceStateError, match="after its finish"):
        seq.append_token(1, now=2.0)
    with pytest.raises(SequenceStateError, match="stopped twice"):
        seq.stop("length")
    seq.finish()
    assert seq.finished and seq.pages == [] and seq.page_keys == [] and seq.state_slot == 0
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 99)
    with pytest.raises(SequenceStateError, match="finished twice"):
        seq.finish()
    for change in (lambda: seq.admit([1], 0), lambda: seq.resume([1], 0), seq.preempt,
                   lambda: seq.launched(7, None), lambda: seq.add_pages([5])):
        with pytest.raises(SequenceStateError, match="it is finished"):
            change()


def test_preemption_drops_progress_and_the_first_admission_counts_the_cache():
    seq = _seq()
    seq.admit([3, 4], 4, page_keys=[b"a", b"b"])
    seq.launched(6, row=0)
    seq.fetched()
    seq.append_token(7, now=0.0)
    seq.preempt()
    assert seq.status is SeqStatus.WAITING and seq.num_computed_tokens == 0 and seq.last_row is None
    assert seq.pages == [] and seq.page_keys == [] and seq.output_token_ids == [7]
    with pytest.raises(SequenceStateError, match="it is waiting"):
        seq.preempt()
    with pytest.raises(SequenceStateError, match="it is waiting"):
        seq.launched(1, None)
    seq.roll_back_to(5)  # a step launched before the preemption: nothing left to roll back
    assert seq.num_computed_tokens == 0
    seq.admit([8, 9], 0)
    assert seq.num_cached_tokens == 4, "counted on the first admission only"
    seq.finish()  # running -> finished
    waiting = _seq()
    waiting.finish()  # waiting -> finished (an abort before admission)
    assert waiting.finished


def test_admission_leaves_a_token_to_compute_and_launches_never_go_back():
    seq = _seq(6)
    with pytest.raises(SequenceStateError, match="at least one"):
        seq.admit([1, 2], 6)
    with pytest.raises(SequenceStateError, match="at least one"):
        seq.resume([1, 2], -1)
    with pytest.raises(SequenceStateError, match="prefix keys"):
        seq.admit([1], 4, page_keys=[b"a", b"b"])
    seq.resume([1, 2], 4)
    assert seq.admitted_once and seq.num_cached_tokens == 0
    with pytest.raises(SequenceStateError, match="it is running"):
        seq.admit([1], 0)
    seq.launched(5, None)
    with pytest.raises(SequenceStateError, match="lowers"):
        seq.launched(4, None)
    with pytest.raises(SequenceStateError, match="no step sampled"):
        seq.fetched()


def test_rollback_of_rejected_drafts():
    seq = _seq(4)
    seq.admit([1, 2], 0)
    seq.launched(4, row=0)
    seq.fetched()
    seq.append_token(50, now=0.0)
    seq.launched(8, row=0)  # its last token and three drafts
    assert seq.num_computed_tokens > seq.num_tokens  # the drafts are in flight
    seq.fetched()
    seq.roll_back_to(6)  # one draft kept
    assert seq.num_computed_tokens == 6
    with pytest.raises(SequenceStateError, match="rolled back"):
        seq.roll_back_to(7)


def test_page_tables_grow_together_and_window_pages_drop_as_a_leading_run():
    seq = _seq(8)
    seq.admit([1, 2], 0, group_pages=[[3, 4]])
    with pytest.raises(SequenceStateError, match="same number"):
        seq.add_pages([5], [[6, 7]])
    with pytest.raises(SequenceStateError, match="same number"):
        seq.add_pages([5])  # a group table left behind
    tables = lambda: [t.tolist() for t in seq.page_tables()]
    assert tables() == [[1, 2], [3, 4]]
    seq.add_pages([5], [[6]])
    assert seq.pages == [1, 2, 5] and seq.group_pages == [[3, 4, 6]]
    assert tables() == [[1, 2, 5], [3, 4, 6]] and seq.page_tables()[0].dtype == np.int32
    assert seq.drop_window_pages(1, 1) == [3]
    assert tables() == [[1, 2, 5], [NULL_PAGE, 4, 6]]  # an entry changed, not the length
    assert seq.drop_window_pages(1, 2) == [4]  # stops at the null run
    assert seq.group_pages == [[NULL_PAGE, NULL_PAGE, 6]] and seq.pages == [1, 2, 5]
    assert tables() == [[1, 2, 5], [NULL_PAGE, NULL_PAGE, 6]]
    seq.add_page_keys([b"a", b"b", b"c"])
    with pytest.raises(SequenceStateError, match="more prefix keys"):
        seq.add_page_keys([b"d"])
    with pytest.raises(SequenceStateError, match="unequal"):
        _seq().admit([1, 2], 0, group_pages=[[3]])
    seq.preempt()
    assert seq.group_pages == [[]] and tables() == [[], []]
    seq.admit([8], 0, group_pages=[[9]])
    assert tables() == [[8], [9]]


def test_drafts_and_borrowed_logprobs():
    seq = _seq(3)
    seq.set_drafts([4, 5])
    assert seq.draft_tokens == [4, 5] and seq.drafts_follow == 3
    seq.set_drafts(None)
    assert seq.draft_tokens == [] and seq.drafts_follow == -1
    seq.append_token(1, now=0.0)
    seq.take_logprobs([{1: -1.0}], -1.0)
    assert seq.logprobs == [{1: -1.0}] and seq.cumulative_logprob == -1.0


# The fields a Sequence changes only through its methods (the text state is output_processor.py's).
STATE_FIELDS = {"status", "pages", "group_pages", "page_keys", "state_slot", "restore_from", "num_computed_tokens",
                "num_pending_tokens", "last_row", "num_cached_tokens", "admitted_once", "output_token_ids",
                "draft_tokens", "drafts_follow", "finish_reason", "stop_reason", "first_token_time", "cumulative_logprob",
                "parent", "matcher", "eos_ids_for_min_tokens"}
# Objects of other types that share a field name (their own attributes, not a Sequence's).
OTHER_TYPES = {("jlight/engine/handoff.py", "c"), ("jlight/engine/llm_engine.py", "req")}


def test_no_module_writes_a_sequence_field():
    root = pathlib.Path(__file__).resolve().parent.parent
    writes = []
    for path in sorted((root / "jlight").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "jlight/engine/sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "append", "extend", "pop", "clear", "insert", "remove"):
                targets = [node.func.value]
            for t in targets:
                if isinstance(t, ast.Subscript):
                    t = t.value
                if not (isinstance(t, ast.Attribute) and t.attr in STATE_FIELDS):
                    continue
                owner = ast.unparse(t.value)
                if owner == "self" or (rel, owner) in OTHER_TYPES:
                    continue
                writes.append(f"{rel}:{node.lineno}: {ast.unparse(t)}")
    assert not writes, "write through Sequence's methods:\n" + "\n".join(writes)
