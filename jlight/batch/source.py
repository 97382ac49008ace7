"""The input JSONL as a grain random-access data source, and the loader that shards and parses it.

The file is indexed once (byte offsets of its non-blank lines), so grain can read any record
by index: that is what lets a restored grain iterator resume mid-file, and lets each
jax.distributed process take its own contiguous shard (described by grain's ShardOptions /
ShardByJaxProcess).
"""
from __future__ import annotations

import os

import grain
import numpy as np

from jlight.batch.records import parse_line


class JsonlSource:
    """grain RandomAccessDataSource: record i is (i, 1-based line number, raw line bytes)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"batch input {path!r} {what}; pass a JSONL file with one request per line")
        self.path = path
        starts, ends, line_numbers = [], [], []
        offset = 0
        with open(path, "rb") as f:
            for line_number, raw in enumerate(f, start=1):
                if raw.strip():
                    starts.append(offset)
                    ends.append(offset + len(raw))
                    line_numbers.append(line_number)
                offset += len(raw)
        self.size_bytes = offset
        self._starts = np.asarray(starts, np.int64)  # [num_records] byte offset of each record
        self._ends = np.asarray(ends, np.int64)  # [num_records]
        self._line_numbers = np.asarray(line_numbers, np.int64)  # [num_records]
        self._fd = None  # opened lazily, so the source pickles into grain workers

    def __repr__(self) -> str:
        # grain checks a restored iterator state against this string: keep it free of addresses.
        return f"JsonlSource({self.path!r}, num_records={len(self)})"

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int):
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        start, end = int(self._starts[index]), int(self._ends[index])
        return int(index), int(self._line_numbers[index]), os.pread(self._fd, end - start, start)

    def __getstate__(self):
        return {**self.__dict__, "_fd": None}

    def line_number(self, index: int) -> int:
        return int(self._line_numbers[index])


class ParseLine(grain.transforms.Map):
    """grain map: (index, line, bytes) -> BatchRequest | BatchError."""

    def __init__(self, sampling_defaults: dict):
        self.sampling_defaults = sampling_defaults

    def map(self, element):
        index, line, raw = element
        return parse_line(index, line, raw, self.sampling_defaults)


def shard_options(process_index: int, process_count: int):
    """grain's ShardByJaxProcess when jax.distributed is running, else no sharding."""
    if process_count > 1:
        return grain.sharding.ShardByJaxProcess(drop_remainder=False)
    return grain.sharding.NoSharding()


def shard_interval(num_records: int, shard) -> tuple[int, int]:
    """[start, end) of this shard: contiguous, the remainder spread over the first shards
    (grain's even split with drop_remainder=False)."""
    per_shard, remainder = divmod(num_records, shard.shard_count)
    start = shard.shard_index * per_shard + min(shard.shard_index, remainder)
    return start, start + per_shard + (1 if shard.shard_index < remainder else 0)


class ShardSlice:
    """grain data source over records [start, end) of a JsonlSource (indices stay global).

    We slice here instead of passing the ShardOptions to grain's IndexSampler because the
    DataLoader of grain 0.2.x gives every shard len // shard_count records, silently dropping
    the remainder of an uneven split even with drop_remainder=False.
    """

    def __init__(self, source: JsonlSource, start: int, end: int):
        self.source, self.start, self.end = source, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int):
        return self.source[self.start + int(index)]

    def __repr__(self) -> str:
        return f"ShardSlice({self.source!r}, {self.start}, {self.end})"


def make_loader(source: JsonlSource, sampling_defaults: dict, shard) -> grain.DataLoader | list:
    """One pass, in file order, over this shard's records, parsed in-process (worker_count=0:
    parsing is cheap next to generation, and the iterator state stays a plain position).
    An empty shard (more processes than records) gives an empty list."""
    records = ShardSlice(source, *shard_interval(len(source), shard))
    if len(records) == 0:
        return []
    sampler = grain.samplers.IndexSampler(len(records), shard_options=grain.sharding.NoSharding(), shuffle=False, num_epochs=1)
    return grain.DataLoader(data_source=records, sampler=sampler, operations=[ParseLine(sampling_defaults)], worker_count=0)
