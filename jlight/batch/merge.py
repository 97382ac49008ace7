"""Merge the processes' answer parts into one output JSONL in input order.

Whichever process finds every part marked done runs the merge. If two do at once they write
the same bytes to their own temp files and rename them over the output one after the other,
so the result is the same.
"""
from __future__ import annotations

import glob
import json
import os

from jlight.batch.part_log import fsync_dir


def all_parts_done(parts_dir: str, process_count: int) -> bool:
    return len(glob.glob(os.path.join(parts_dir, f"part-*-of-{process_count:05d}.done"))) == process_count


def merge_parts(parts_dir: str, process_count: int, num_records: int, output_path: str) -> int:
    """Write output_path from the parts; returns the number of lines written.

    Raises RuntimeError if a record is missing or duplicated (a bug, never bad input).
    """
    by_index: dict[int, bytes] = {}
    for path in sorted(glob.glob(os.path.join(parts_dir, f"part-*-of-{process_count:05d}.jsonl"))):
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    continue  # torn tail of a killed writer; its request was re-run
                record = json.loads(raw)
                index = record.pop("index")
                if index in by_index:
                    raise RuntimeError(f"record {index} is answered twice in {parts_dir}; this is a jlight bug")
                by_index[index] = json.dumps(record, ensure_ascii=False).encode() + b"\n"
    missing = [i for i in range(num_records) if i not in by_index]
    if missing:
        raise RuntimeError(f"{len(missing)} records have no answer in {parts_dir} (first: {missing[:5]}); rerun the job to finish them")
    tmp = f"{output_path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        for i in range(num_records):
            f.write(by_index[i])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output_path)
    fsync_dir(os.path.dirname(os.path.abspath(output_path)))
    return num_records
