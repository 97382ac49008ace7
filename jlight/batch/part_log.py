"""One process's share of a batch job on disk: its answers (append-only JSONL) and its checkpoint.

Exactly-once across SIGKILLs rests on three rules:
1. An answer is one `os.write` of a whole line to an O_APPEND file, then fsync. A kill can only
   leave a torn *last* line, which `open()` cuts off (that request simply runs again).
2. The answers file itself is the truth about what is done: on restart every line already in it
   is skipped, so nothing is answered twice whatever the checkpoint says.
3. The checkpoint (grain iterator state + bookkeeping) is written after the answers it covers
   are fsynced, to a temp file that is fsynced and renamed over the old one. It only records a
   position whose every earlier record is answered, so resuming from it never skips a line.
"""
from __future__ import annotations

import json
import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj) -> None:
    """Write JSON so a reader sees the old file or the new one, never a mix (survives SIGKILL)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class PartLog:
    def __init__(self, parts_dir: str, process_index: int, process_count: int):
        self.parts_dir = parts_dir
        stem = os.path.join(parts_dir, f"part-{process_index:05d}-of-{process_count:05d}")
        self.answers_path = stem + ".jsonl"
        self.state_path = stem + ".state.json"
        self.done_path = stem + ".done"
        self.done_indices: set[int] = set()
        self._fd = None

    def open(self) -> None:
        """Create or recover the answers file: drop a torn last line, collect what is done."""
        os.makedirs(self.parts_dir, exist_ok=True)
        if os.path.exists(self.answers_path):
            with open(self.answers_path, "rb") as f:
                data = f.read()
            keep = data.rfind(b"\n") + 1  # bytes up to the last complete line
            if keep != len(data):
                os.truncate(self.answers_path, keep)
            for raw in data[:keep].splitlines():
                self.done_indices.add(json.loads(raw)["index"])
        self._fd = os.open(self.answers_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fsync_dir(self.parts_dir)

    def append(self, records: list[dict]) -> None:
        """Append finished records (each must carry its record `index`) and make them durable."""
        if not records:
            return
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        view = memoryview(data)
        while view:  # a regular-file write is whole in practice; loop in case it is not
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        self.done_indices.update(r["index"] for r in records)

    def load_state(self) -> dict | None:
        try:
            with open(self.state_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def save_state(self, state: dict) -> None:
        write_json_atomic(self.state_path, state)

    def mark_done(self, summary: dict) -> None:
        write_json_atomic(self.done_path, summary)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
