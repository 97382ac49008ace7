"""Offline batch inference over a JSONL file (`jlight batch`), read through grain, resumable,
split across jax.distributed processes. The CLI entry points are add_arguments and run."""
from jlight.batch.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
