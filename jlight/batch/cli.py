"""`jlight batch INPUT -o OUTPUT`: answer every line of a JSONL file, resumably, on 1..N processes.

Run the same command again after a crash or kill and it picks up where it stopped. With
`--num-processes N` start the command once per process (each with its `--process-id`); each
answers its own shard of the input, and the last to finish merges the parts into OUTPUT.
Work files live in OUTPUT.parts/ (kept after the merge, so a rerun is a quick no-op).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax

import jlight
from jlight.batch import merge
from jlight.batch.part_log import PartLog
from jlight.batch.runner import ShardRunner
from jlight.batch.source import JsonlSource, make_loader, shard_interval, shard_options
from jlight.engine.sampling_params import SamplingParams
from jlight.engine_args import add_engine_arguments, engine_options
from jlight.progress import log_to_stderr

# Engine sizes of a batch job unless given: enough rows and tokens per step to keep a GPU busy.
BATCH_ENGINE_DEFAULTS = dict(max_num_seqs=64, max_num_batched_tokens=512)
# CLI flag -> SamplingParams field used as the job-wide default (a line's own field wins).
_SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                   "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL file: one {\"prompt\": ...} or {\"messages\": [...]} object per line")
    parser.add_argument("-o", "--output", required=True,
                        help="JSONL file to write, one answer per input line, in input order: text, token_ids, "
                             "finish_reason, token counts, and logprobs / prompt_logprobs when the line asks for them")
    # The engine options of generate/chat/serve (the mesh is each process's own); batch's own
    # defaults for the sizes are in BATCH_ENGINE_DEFAULTS.
    add_engine_arguments(parser)
    sampling = parser.add_argument_group("sampling defaults (each input line may override them)")
    for name, kind in _SAMPLING_FLAGS.items():
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None, dest=name)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--max-inflight", type=int, default=None, help="requests kept in the engine (default: 2 x --max-num-seqs)")
    parser.add_argument("--checkpoint-interval", type=float, default=1.0, help="seconds between progress checkpoints")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or summary line (elsewhere)")
    dist = parser.add_argument_group("multi-process (jax.distributed)")
    dist.add_argument("--num-processes", type=int, default=1)
    dist.add_argument("--process-id", type=int, default=0)
    dist.add_argument("--coordinator-address", default=None, help="host:port of process 0's coordinator")


def sampling_defaults(args) -> dict:
    defaults = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        defaults["stop"] = args.stop
    return defaults


def _check_args(args) -> None:
    if args.num_processes < 1:
        raise ValueError(f"--num-processes {args.num_processes} must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be in [0, {args.num_processes}) for --num-processes {args.num_processes}")
    if args.num_processes > 1 and not args.coordinator_address:
        raise ValueError("--num-processes > 1 needs --coordinator-address host:port (the same on every process)")
    if args.max_inflight is not None and args.max_inflight < 1:
        raise ValueError(f"--max-inflight {args.max_inflight} must be >= 1")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ValueError("-o must differ from INPUT; the input is read while answers are written")


def _start_distributed(args) -> tuple[int, int]:
    if args.num_processes > 1:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)
    return jax.process_index(), jax.process_count()


def run(args: argparse.Namespace, llm=None) -> int:
    """Run (or resume) the job `args` describes; `llm` reuses an already loaded jlight.LLM."""
    _check_args(args)
    defaults = sampling_defaults(args)
    try:
        SamplingParams(**defaults).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"sampling options: {e}") from None
    source = JsonlSource(args.input)
    process_index, process_count = _start_distributed(args)
    parts_dir = args.output + ".parts"
    fingerprint = {"input": os.path.abspath(args.input), "input_bytes": source.size_bytes,
                   "num_records": len(source), "process_count": process_count, "sampling": defaults}
    shard = shard_options(process_index, process_count)
    start, end = shard_interval(len(source), shard)
    if end > start:
        llm = llm or _make_llm(args)
        runner = ShardRunner(
            llm, make_loader(source, defaults, shard), PartLog(parts_dir, process_index, process_count),
            job_fingerprint=fingerprint, shard_size=end - start,
            max_inflight=args.max_inflight or 2 * (args.max_num_seqs or BATCH_ENGINE_DEFAULTS["max_num_seqs"]),
            checkpoint_interval_s=args.checkpoint_interval, show_progress=not args.no_progress,
        )
        summary = runner.run()
    else:  # nothing in this shard: no model needed
        os.makedirs(parts_dir, exist_ok=True)
        PartLog(parts_dir, process_index, process_count).mark_done({"answered": 0, "job": fingerprint})
        summary = {"answered": 0}
    if merge.all_parts_done(parts_dir, process_count):
        merge.merge_parts(parts_dir, process_count, len(source), args.output)
        print(f"wrote {args.output}: {len(source)} lines", file=sys.stderr)
    else:
        print(f"process {process_index}: answered {summary['answered']} lines; the last process to finish writes {args.output}", file=sys.stderr)
    return 0


def _make_llm(args):
    log_to_stderr()  # the start-up's phase lines and the summary line, as "jlight: ..." on stderr
    return jlight.LLM(args.model, **engine_options(args, **BATCH_ENGINE_DEFAULTS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jlight batch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:
        print(f"jlight batch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
