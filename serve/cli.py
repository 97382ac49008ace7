"""`jlight serve [MODEL] ...`: load a model and serve it over HTTP (OpenAI-compatible).

jlight/cli.py dispatches here: `add_arguments(parser)` fills the subcommand's parser and
`run(args)` serves until SIGTERM/SIGINT, then drains (serve/drain.py: /health and new requests
get 503 at once, running ones have --shutdown-timeout seconds to finish, then end with
finish_reason "abort") and returns 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from jlight.api import LLM
from jlight.engine.async_engine import AsyncLLM
from jlight.engine.disaggregated_roles import join_pair
from jlight.engine_args import add_engine_arguments, engine_options
from jlight.loading.default_model import DEFAULT_MODEL_NAME
from jlight.serve.defaults import (DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS,
                                  DEFAULT_SHUTDOWN_TIMEOUT_S)
from jlight.serve.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("jlight.serve")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, model_positional=True)  # the same engine options as `jlight generate`
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=os.environ.get("JLIGHT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(default: $JLIGHT_API_KEY)")
    server.add_argument("--served-model-name", action="append", default=None,
                        help="name clients use for the model (repeatable; default: the model path or hub id given, "
                             "SmolLM2-135M-Instruct when none is)")
    server.add_argument("--max-waiting-requests", type=_positive_int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="answer 503 + Retry-After beyond this many requests waiting for their first token")
    server.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="answer 413 to request bodies larger than this")
    server.add_argument("--shutdown-timeout", type=_non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="the drain's deadline: on SIGTERM or Ctrl-C, /health and new requests get 503 at once and "
                             "the running requests have this many seconds to finish; then each ends with "
                             f"finish_reason \"abort\" (default {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})")
    server.add_argument("--timeout-keep-alive", type=_non_negative_float, default=DEFAULT_KEEP_ALIVE_S,
                        help="seconds an idle HTTP connection stays open; keep it above your clients' idle expiry "
                             f"(default {DEFAULT_KEEP_ALIVE_S:.0f})")
    server.add_argument("--host-workers", type=_positive_int, default=None,
                        help="threads that parse, template, tokenize and render requests off the event loop "
                             "(default: one per core this process may use)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    pd = parser.add_argument_group("disaggregated prefill and decode in separate processes (docs/ARCHITECTURE.md)")
    pd.add_argument("--disaggregated-role", choices=["prefill", "decode", "router"], default=None,
                    help="prefill / decode: this server's role in a pair joined by jax.distributed (the prefill process "
                         "runs the coordination service at --coordinator-address), each over every device of its own "
                         "process; router: no model, an OpenAI front that sends each request through --prefill and "
                         "then --decode and streams the decode server's answer")
    pd.add_argument("--coordinator-address", default=None,
                    help="prefill / decode: host:port of the pair's coordination service (the prefill process's host), "
                         "the same for both")
    pd.add_argument("--kv-transfer-address", default=None,
                    help="prefill / decode: host:port where this process serves the K/V pages the other pulls (JAX's "
                         "socket transfers); default on one host: the coordinator's port + 1 (prefill) or + 2 (decode)")
    pd.add_argument("--kv-transfer-timeout", type=_non_negative_float, default=None,
                    help="prefill / decode: seconds a handoff's pages wait to be asked for, and to arrive, before the "
                         "decode side recomputes the prompt (default 300)")
    pd.add_argument("--prefill", default=None, help="router: the prefill server's URL, e.g. http://127.0.0.1:8001")
    pd.add_argument("--decode", default=None, help="router: the decode server's URL, e.g. http://127.0.0.1:8002")
    tools = parser.add_argument_group("tool calls (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (the default with tools): the model chooses, and the calls '
                            "it writes are found by --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                       help="the model's tool-call format: hermes, <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5, "
                            'Qwen3); llama3_json, an answer of {"name", "parameters"} objects (Llama 3.1-3.3); mistral, '
                            'an answer that is a JSON array of {"name", "arguments"} objects (Mistral, tokenizer v3)')


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None (a 400 then); the two flags only make sense together."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give both "
                         "(e.g. --enable-auto-tool-choice --tool-call-parser hermes) or neither")
    return args.tool_call_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jlight serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def served_model_names(args: argparse.Namespace) -> list[str] | None:
    """--served-model-name, else None (the engine's name: the path or hub id given). With no
    model the engine loads SmolLM2 from a cache file whose path clients cannot guess (and
    should not see), so it is served as "SmolLM2-135M-Instruct"."""
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return [DEFAULT_MODEL_NAME]
    return None


def disaggregated_options(args: argparse.Namespace) -> dict:
    """The engine options of --disaggregated-role prefill|decode, having joined this process to the pair."""
    role = getattr(args, "disaggregated_role", None)
    pd_flags = ("coordinator_address", "kv_transfer_address", "kv_transfer_timeout")
    if role not in ("prefill", "decode"):
        given = [f"--{name.replace('_', '-')}" for name in pd_flags if getattr(args, name, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} go with --disaggregated-role prefill or decode; add the role or drop them")
        return {}
    if not args.coordinator_address:
        raise ValueError(f"--disaggregated-role {role} needs --coordinator-address HOST:PORT (the prefill process's host, "
                         "the same for both roles)")
    join_pair(role, args.coordinator_address, args.kv_transfer_address)
    options = {"disaggregated_role": role}
    if args.kv_transfer_timeout is not None:
        options["kv_transfer_timeout_s"] = args.kv_transfer_timeout
    return options


def run_router(args: argparse.Namespace) -> int:
    """--disaggregated-role router: the front of a prefill server and a decode server (serve/router.py)."""
    import uvicorn

    from jlight.serve.router import build_router_app

    if not args.prefill or not args.decode:
        raise ValueError("--disaggregated-role router needs --prefill URL and --decode URL (the two servers it joins)")
    if args.model is not None:
        raise ValueError("--disaggregated-role router loads no model (the prefill and decode servers do); drop MODEL")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_router_app(args.prefill, args.decode)
    logger.info("routing on http://%s:%d: prefill %s, then decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "debug",
                timeout_keep_alive=args.timeout_keep_alive)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "disaggregated_role", None) == "router":
        return run_router(args)
    if getattr(args, "prefill", None) or getattr(args, "decode", None):
        raise ValueError("--prefill and --decode are the router's (--disaggregated-role router); drop them")
    # The web stack (uvicorn, fastapi under serve.app) loads only when the server runs, not for every `jlight` command.
    import uvicorn

    from jlight.serve.app import build_app
    from jlight.serve.drain import DrainingServer
    from jlight.serve.host_work import HostWork

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = tool_call_parser(args)  # before the model loads: a bad flag pair fails at once
    llm = LLM(args.model, **engine_options(args), **disaggregated_options(args))
    host = HostWork(args.host_workers)
    async_llm = AsyncLLM(llm, max_waiting_requests=args.max_waiting_requests, executor=host.pool)
    app = build_app(async_llm, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                    max_body_bytes=args.max_body_bytes, served_model_names=served_model_names(args),
                    tool_call_parser=parser, host=host, shutdown_timeout_s=args.shutdown_timeout)
    # The drain (DrainingServer) has answered or aborted every request before uvicorn's own shutdown,
    # which then only closes connections; its timeout bounds what a client that does not read can hold.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=1, access_log=args.log_level == "debug",
                            timeout_keep_alive=args.timeout_keep_alive)
    # uvicorn re-raises the exit signal once the server has stopped, so the default action would
    # kill us with status 143; a no-op handler installed first makes it return instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s as %s on http://%s:%d (%d host workers)", llm.model_name,
                served_model_names(args) or [llm.model_name], args.host, args.port, host.num_workers)
    DrainingServer(config, app.state.drain).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jlight.serve.cli` (the `jlight serve` command goes through jlight/cli.py)."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # bad model path or options: one line, not a traceback
        print(f"jlight serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
