"""The `jlight` command: generate, chat, serve, batch, convert.

User errors (bad paths, unsupported models, prompts too long, bad options) print one line
and exit with status 2; nothing a user can cause prints a traceback.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import time

from jlight.api import LLM
from jlight.core.errors import JlightError
from jlight.engine.sampling_params import SamplingParams
from jlight.engine_args import add_engine_arguments, engine_options
from jlight.progress import log_to_stderr
from jlight.sharding.distributed import initialize

# Subcommands that live in other rooms: name -> (module with add_arguments/run, help).
_EXTERNAL = {
    "serve": ("jlight.serve.cli", "run the OpenAI-compatible HTTP server"),
    "batch": ("jlight.batch.cli", "run a model over a JSONL file of requests (resumable)"),
    "convert": ("jlight.convert", "write a model as an orbax checkpoint that loads into any mesh"),
}


def _distributed_arguments(p: argparse.ArgumentParser) -> None:
    """One mesh over several processes (hosts), through JAX's own runtime (jax.distributed)."""
    p.add_argument("--coordinator-address", default=None, help="host:port of process 0 (the same on every process)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)


def _start_distributed(args) -> None:
    if args.coordinator_address or args.num_processes or args.process_id is not None:
        # Every process runs the same command; their engines step in lockstep over one mesh.
        initialize(args.coordinator_address, args.num_processes, args.process_id)


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _sampling_params(args):
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed).validate()


def _load(args, warmup: bool = True):
    """warmup=False: compile no step bucket at start-up (`generate` compiles only its request's, below)."""
    log_to_stderr()  # the start-up's phase lines (load, compile, ready), as "jlight: ..." on stderr
    # One interactive request at a time: one sequence (its K/V pool holds one full-length context, not the
    # default's many) and small steps keep the start short.
    return LLM(args.model, **engine_options(args, max_num_seqs=1, max_num_batched_tokens=256, warmup=warmup))


def _stream_one(llm, prompt_ids: list[int], params) -> tuple[list[int], float | None, float]:
    """Print one request's text as it comes; return (output ids, ttft seconds, total seconds)."""
    engine = llm.engine
    rid = f"cli-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, None, params, prompt_token_ids=prompt_ids)
    ttft, ids = None, []
    try:
        done = False
        while not done:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                c = out.outputs[0]
                if c.token_ids_delta and ttft is None:
                    ttft = time.perf_counter() - t0
                sys.stdout.write(c.text_delta)
                sys.stdout.flush()
                ids = c.token_ids
                done = out.finished
    finally:
        engine.abort_request(rid)
    return ids, ttft, time.perf_counter() - t0


def _summary(n_prompt: int, ids: list[int], ttft: float | None, total: float) -> str:
    decode_time = total - (ttft or 0.0)
    rate = (len(ids) - 1) / decode_time if len(ids) > 1 and decode_time > 0 else 0.0
    ttft_ms = f"{ttft * 1000:.0f} ms" if ttft is not None else "n/a"
    return f"[prompt {n_prompt} tokens | generated {len(ids)} tokens | time to first token {ttft_ms} | {rate:.1f} tokens/s]"


def cmd_generate(args) -> int:
    params = _sampling_params(args)
    _start_distributed(args)
    llm = _load(args, warmup=False)
    if args.no_chat or llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        prompt_ids = llm.tokenizer.encode(args.prompt) if llm.tokenizer is not None else None
        if prompt_ids is None:
            raise ValueError("this model has no tokenizer; jlight generate needs one")
    else:
        prompt_ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    llm.engine.validate_request(None, params, prompt_ids)
    # Compile only the steps this one request runs (its prefill chunks, then one-token decode steps),
    # before timing it: it starts sooner than compiling every bucket, a prompt that is too long is refused
    # before anything compiles, and the time to first token and tokens/s printed below stay compile-free.
    llm.engine.warmup_for_one_request(len(prompt_ids))
    ids, ttft, total = _stream_one(llm, prompt_ids, params)
    print()
    print(_summary(len(prompt_ids), ids, ttft, total), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    if llm.tokenizer is None:
        raise ValueError("this model has no tokenizer; jlight chat needs one")
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("jlight chat — empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = llm.apply_chat_template(history)
        try:
            llm.engine.validate_request(None, params, prompt_ids)
        except ValueError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        ids, ttft, total = _stream_one(llm, prompt_ids, params)
        print()
        history.append({"role": "assistant", "content": llm.tokenizer.decode(ids)})
        if args.verbose:
            print(_summary(len(prompt_ids), ids, ttft, total), file=sys.stderr)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand. An external one's module (serve, batch, convert, bench serve: their own
    dependencies, grain's import alone takes 0.3 s) is imported for its arguments only when `argv` (default:
    sys.argv[1:]) names it: `jlight generate` starts without them, `jlight --help` lists them all."""
    words = _command(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="jlight", description="A JAX/XLA inference engine for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    g.add_argument("prompt")
    add_engine_arguments(g)
    _sampling_arguments(g)
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    _distributed_arguments(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with history")
    add_engine_arguments(c)
    _sampling_arguments(c)
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("--verbose", action="store_true", help="print timing after each answer")
    c.set_defaults(func=cmd_chat)
    for name, (module, help_text) in _EXTERNAL.items():
        _add_external(sub, name, module, help_text, words[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_external(bench, "serve", "jlight.serve.bench_cli", "load an OpenAI-compatible server the way vLLM's benchmark_serving does",
                  words == ["bench", "serve"])
    return parser


def _command(argv: list[str]) -> list[str]:
    """The subcommand's words of a command line (`["generate"]`, `["bench", "serve"]`): its first two words that
    are not options (the top level takes none)."""
    return [w for w in argv if not w.startswith("-")][:2]


def _add_external(sub, name: str, module: str, help_text: str, chosen: bool) -> None:
    """The subcommand `name`, run by `module`; its arguments only when it is the chosen one (build_parser)."""
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(external=module)
    if not chosen:
        return
    try:
        importlib.import_module(module).add_arguments(p)
    except ImportError as e:  # optional dependency missing (e.g. fastapi for serve)
        p.set_defaults(import_error=f"jlight {name} needs a package that is not installed: {e.name}; pip install it")


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        if getattr(args, "import_error", None):
            raise JlightError(args.import_error)
        if getattr(args, "external", None):
            rc = importlib.import_module(args.external).run(args)
            return rc if isinstance(rc, int) else 0
        return args.func(args)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"jlight: error: {e}", file=sys.stderr)
        # Work the error abandoned (orbax's reads of a damaged checkpoint) may print "Exception ignored"
        # tracebacks as it is collected at exit; the line above is all the user needs.
        sys.unraisablehook = lambda unraisable: None
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def entry() -> None:
    """The `jlight` command (and `python -m jlight.cli`). A `generate` or `chat` process ends without the
    interpreter's teardown: freeing the model, its compiled steps and the XLA client object by object took
    0.7 s of a 5-6 s warm `jlight generate` on two cores. The exit handlers still run (logging's among them),
    and both streams are flushed first. Other commands exit as usual."""
    argv = sys.argv[1:]
    rc = main(argv)
    if _command(argv)[:1] in (["generate"], ["chat"]):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
