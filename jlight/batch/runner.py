"""Feeds one process's shard of a batch job through the engine, continuously and resumably.

The engine's queue is kept topped up to `max_inflight` requests: whenever a request finishes,
the next input line is added before the following step, so there are no batch barriers and
the scheduler always has work. Each finished request is appended to the PartLog at once.

Resume bookkeeping: after taking each record from the grain iterator we keep the iterator state
*after* it. The checkpoint is the state after the longest fully answered prefix of what was
taken (the "low watermark"); records past it that were answered before a kill are skipped on
restart because the answers file lists them.
"""
from __future__ import annotations

import collections
import time

from jlight.batch.part_log import PartLog
from jlight.batch.records import BatchError, BatchRequest, error_record, result_record


class ShardRunner:
    def __init__(self, llm, loader, part_log: PartLog, *, job_fingerprint: dict, shard_size: int | None,
                 max_inflight: int, checkpoint_interval_s: float = 1.0, show_progress: bool = True):
        self.llm = llm
        self.engine = llm.engine
        self.loader = loader
        self.log = part_log
        self.fingerprint = job_fingerprint
        self.shard_size = shard_size
        self.max_inflight = max_inflight
        self.checkpoint_interval_s = checkpoint_interval_s
        self.show_progress = show_progress
        self.generated_tokens = 0

    def run(self) -> dict:
        """Answer every record of this shard not already answered; returns a summary."""
        self.log.open()
        iterator = iter(self.loader)
        saved = self.log.load_state()
        if saved is not None:
            if saved["job"] != self.fingerprint:
                raise ValueError(
                    f"the checkpoint in {self.log.parts_dir} belongs to another job ({saved['job']}); "
                    "rerun with the same input and process count, or delete that folder to start over"
                )
            iterator.set_state(saved["grain_state"].encode())
        taken = collections.deque()  # (record index, grain state after it), in the order taken
        inflight: dict[str, BatchRequest] = {}
        exhausted = False
        checkpoint_state, last_save = None, time.monotonic()
        progress = self._progress_bar()
        start = time.monotonic()
        while True:
            finished_records = []
            while not exhausted and len(inflight) < self.max_inflight:
                try:
                    item = next(iterator)
                except StopIteration:
                    exhausted = True
                    break
                taken.append((item.index, iterator.get_state()))
                if item.index in self.log.done_indices:
                    continue  # answered before a restart
                if isinstance(item, BatchError):
                    finished_records.append({"index": item.index, **error_record(item)})
                    continue
                rejection = self._submit(item)
                if rejection is None:
                    inflight[str(item.index)] = item
                else:
                    finished_records.append({"index": item.index, **error_record(rejection)})
            if inflight:
                for output in self.engine.step():
                    if output.finished and output.request_id in inflight:
                        request = inflight.pop(output.request_id)
                        record = result_record(request, output)
                        self.generated_tokens += record["completion_tokens"]
                        finished_records.append({"index": request.index, **record})
            self.log.append(finished_records)
            if progress is not None and finished_records:
                progress.update(len(finished_records))
                elapsed = max(time.monotonic() - start, 1e-9)
                progress.set_postfix(gen_tok_s=f"{self.generated_tokens / elapsed:.1f}", refresh=False)
            while taken and taken[0][0] in self.log.done_indices:
                checkpoint_state = taken.popleft()[1]
            if checkpoint_state is not None and time.monotonic() - last_save >= self.checkpoint_interval_s:
                self._save(checkpoint_state)
                last_save = time.monotonic()
            if exhausted and not inflight:
                break
        if checkpoint_state is not None:
            self._save(checkpoint_state)
        if progress is not None:
            progress.close()
        summary = {"answered": len(self.log.done_indices), "generated_tokens_this_run": self.generated_tokens,
                   "seconds_this_run": time.monotonic() - start}
        self.log.mark_done({**summary, "job": self.fingerprint})
        self.log.close()
        return summary

    def _submit(self, request: BatchRequest) -> BatchError | None:
        """Add the request to the engine; an input the engine refuses becomes an error record."""
        try:
            prompt, token_ids = request.prompt, None
            if request.messages is not None:
                # As LLM.chat does: the rendered template already holds BOS, so pass its token ids.
                prompt, token_ids = None, self.llm.apply_chat_template(request.messages, add_generation_prompt=True)
            elif isinstance(prompt, list):
                prompt, token_ids = None, prompt
            self.engine.add_request(str(request.index), prompt, request.sampling_params, prompt_token_ids=token_ids)
        except ValueError as e:  # includes jlight.errors (too-long prompt, bad token ids, ...)
            return BatchError(request.index, request.line, request.id, f"line {request.line}: {e}")
        return None

    def _save(self, grain_state) -> None:
        state = grain_state.decode() if isinstance(grain_state, bytes) else grain_state
        self.log.save_state({"grain_state": state, "job": self.fingerprint})

    def _progress_bar(self):
        if not self.show_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.shard_size, initial=len(self.log.done_indices), unit="req", desc="batch", dynamic_ncols=True)
