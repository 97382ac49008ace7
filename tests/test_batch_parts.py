"""The pieces under `jlight batch` that need no model: the grain source and its resumable
iterator, the answers log's crash recovery, and the merge's exactly-once check."""
from __future__ import annotations

import json

import grain
import pytest

from jlight.batch import merge
from jlight.batch.part_log import PartLog
from jlight.batch.records import BatchError, BatchRequest
from jlight.batch.source import JsonlSource, make_loader


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_source_indexes_non_blank_lines_and_resumes_from_grain_state(tmp_path):
    text = "".join(json.dumps({"prompt": f"p{i}"}) + "\n" + ("\n" if i % 3 == 0 else "") for i in range(10))
    source = JsonlSource(_write(tmp_path / "in.jsonl", text))
    assert len(source) == 10
    index, line, raw = source[4]
    assert (index, line, json.loads(raw)) == (4, 7, {"prompt": "p4"})  # lines 2, 5 are blank
    iterator = iter(make_loader(source, {"max_tokens": 3}, grain.sharding.NoSharding()))
    first = [next(iterator) for _ in range(4)]
    assert all(isinstance(r, BatchRequest) and r.sampling_params.max_tokens == 3 for r in first)
    state = iterator.get_state()
    resumed = iter(make_loader(JsonlSource(source.path), {"max_tokens": 3}, grain.sharding.NoSharding()))
    resumed.set_state(state)  # a fresh source object: the state must not depend on object identity
    assert [r.index for r in resumed] == [4, 5, 6, 7, 8, 9]


def test_uneven_shards_cover_every_record_once(tmp_path):
    source = JsonlSource(_write(tmp_path / "in.jsonl", "".join(json.dumps({"prompt": "x"}) + "\n" for _ in range(7))))
    shards = [[r.index for r in make_loader(source, {}, grain.sharding.ShardOptions(i, 2))] for i in range(2)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6]]
    shards = [[r.index for r in make_loader(source, {}, grain.sharding.ShardOptions(i, 9))] for i in range(9)]
    assert shards == [[i] for i in range(7)] + [[], []]


def test_part_log_drops_a_torn_last_line_and_knows_what_is_done(tmp_path):
    log = PartLog(str(tmp_path / "parts"), 0, 1)
    log.open()
    log.append([{"index": 0, "text": "a"}, {"index": 2, "text": "b"}])
    log.close()
    with open(log.answers_path, "ab") as f:
        f.write(b'{"index": 5, "te')  # a write cut short by SIGKILL
    recovered = PartLog(str(tmp_path / "parts"), 0, 1)
    recovered.open()
    assert recovered.done_indices == {0, 2}
    recovered.append([{"index": 5, "text": "c"}])
    recovered.close()
    with open(log.answers_path) as f:
        assert [json.loads(line)["index"] for line in f] == [0, 2, 5]


def test_merge_orders_by_index_and_refuses_missing_or_duplicate_answers(tmp_path):
    parts = str(tmp_path / "parts")
    for pid, indices in enumerate([[1, 0], [3, 2]]):
        log = PartLog(parts, pid, 2)
        log.open()
        log.append([{"index": i, "line": i + 1} for i in indices])
        log.close()
    out = str(tmp_path / "out.jsonl")
    merge.merge_parts(parts, 2, 4, out)
    with open(out) as f:
        assert [json.loads(line) for line in f] == [{"line": 1}, {"line": 2}, {"line": 3}, {"line": 4}]
    with pytest.raises(RuntimeError, match="no answer"):
        merge.merge_parts(parts, 2, 5, out)
    log = PartLog(parts, 1, 2)
    log.open()
    log.append([{"index": 0, "line": 1}])
    log.close()
    with pytest.raises(RuntimeError, match="twice"):
        merge.merge_parts(parts, 2, 4, out)


def test_bad_lines_parse_to_errors_with_line_numbers(tmp_path):
    lines = ['{"prompt": "ok", "top_k": 5}', "nope", '{"prompt": ""}', '{"messages": []}', '{"prompt": "x", "n": 0}',
             '{"prompt": "x", "stop": "END"}']
    source = JsonlSource(_write(tmp_path / "in.jsonl", "\n".join(lines) + "\n"))
    records = list(make_loader(source, {"max_tokens": 4}, grain.sharding.NoSharding()))
    assert isinstance(records[0], BatchRequest) and records[0].sampling_params.top_k == 5
    assert records[0].id == "line-1"
    for line, record, fragment in zip([2, 3, 4, 5], records[1:5], ["not valid JSON", "'prompt' must be", "'messages' must be", "n=0"]):
        assert isinstance(record, BatchError) and record.line == line
        assert f"line {line}" in record.error and fragment in record.error, record.error
    assert records[5].sampling_params.stop == ["END"]


@pytest.mark.parametrize("fields, field", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": None}, "top_p"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": 7}, "stop_token_ids"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"), ({"n": True}, "n"),
])
def test_wrong_typed_sampling_fields_are_errors_naming_the_field(fields, field):
    """A wrong type is the user's error like a wrong value: a ValueError naming the field (a batch line's
    error record), never a TypeError, nor a value that passes and then fails (or misbehaves) in the step."""
    from jlight.batch.records import parse_line
    from jlight.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=f"^{field}=") as e:
        SamplingParams(**fields).validate(vocab_size=512)
    record = parse_line(0, 3, json.dumps({"prompt": "hi", **fields}).encode(), {})
    assert isinstance(record, BatchError) and record.error == f"line 3: {e.value}"
    assert SamplingParams(logit_bias={"5": 2, 7: -1.5}, stop=("a",)).validate(vocab_size=512).stop == ["a"]  # JSON's keys are strings


def test_a_directory_as_input_is_named_as_such(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):  # it said "does not exist"
        JsonlSource(str(tmp_path))
