"""The server's chaos suite (benchmarks/chaos_cases.py) against a running `jlight serve`.

  python benchmarks/chaos.py serve MODEL [jlight serve options]
      `jlight serve`, plus one fault: an engine step that schedules a request whose prompt is
      chaos_cases.POISON_PROMPT raises (the step_failure case needs it; nothing else changes).
  python benchmarks/chaos.py run --base-url URL [--api-key KEY] [--server-pid PID]
                                 [--shutdown-timeout S] [--scale K] [--cases a,b,...] [--out FILE.json]
      every case in order (sigterm_mid_stream, which stops the server, last; it needs --server-pid
      and the server's --shutdown-timeout), a line per case, the measurements as JSON. Exit 1 if a
      promise broke. --scale K multiplies the counts (streams, readers, requests) for a bigger server.

tests/test_server_chaos.py runs the cases at CI sizes on a tiny model; `bash benchmarks/gpu.sh chaos`
runs them on the H200 against a random 8B checkpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos_cases import CASES, POISON_PROMPT  # noqa: E402
from chaos_client import ChaosFailure, Target  # noqa: E402


class InjectedStepFailure(RuntimeError):
    pass


def install_step_fault() -> None:
    """Every Scheduler.schedule whose plan holds a POISON_PROMPT sequence raises, mid-step (pages already
    taken), as a device error would: the engine must free them and fail only what it held."""
    from jlight.engine.scheduler import Scheduler

    schedule = Scheduler.schedule

    def faulty_schedule(self):
        plan = schedule(self)
        if any(row.seq.prompt_token_ids == POISON_PROMPT for row in plan.rows):
            raise InjectedStepFailure("the chaos suite's poisoned prompt was scheduled")
        return plan
    Scheduler.schedule = faulty_schedule


def serve(argv: list[str]) -> int:
    from jlight.serve import cli

    install_step_fault()
    return cli.main(argv)


def scaled(name: str, scale: float) -> dict:
    """A case's counts for a server `scale` times the CI one."""
    k = lambda n: max(1, int(round(n * scale)))  # noqa: E731
    return {"disconnect_storm": {"streams": k(48)}, "slow_readers": {"readers": k(3), "others": k(8)},
            "step_failure": {"bystanders": k(4), "after": k(8)},
            "many_requests_flat_rss": {"requests": k(1000), "concurrency": k(32)},
            "sigterm_mid_stream": {"streams": k(32)}}.get(name, {}) if scale != 1 else {}


async def run_cases(target: Target, names: list[str], scale: float) -> tuple[dict, list[str]]:
    await target.connect()
    results, failed = {}, []
    for name in names:
        start = time.perf_counter()
        try:
            measured = await CASES[name](target, **scaled(name, scale))
            results[name] = {"passed": True, "seconds": round(time.perf_counter() - start, 2), **measured}
            print(f"PASS {name} ({results[name]['seconds']} s): {json.dumps(measured)}", flush=True)
        except (ChaosFailure, httpx.HTTPError) as e:  # an HTTP error: the server broke a connection it owed an answer
            failed.append(name)
            failure = str(e) if isinstance(e, ChaosFailure) else f"{type(e).__name__}: {e}"
            results[name] = {"passed": False, "seconds": round(time.perf_counter() - start, 2), "failure": failure}
            print(f"FAIL {name}: {failure}", flush=True)
    return results, failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="chaos.py run", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default=os.environ.get("JLIGHT_API_KEY"))
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="the server's --shutdown-timeout")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="the server's --max-body-bytes")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if "sigterm_mid_stream" in names:  # it stops the server
        names = [n for n in names if n != "sigterm_mid_stream"] + ["sigterm_mid_stream"]
    target = Target(args.base_url, args.api_key, args.server_pid, args.shutdown_timeout)
    if args.max_body_bytes:
        target.max_body_bytes = args.max_body_bytes
    results, failed = asyncio.run(run_cases(target, names, args.scale))
    report = {"base_url": args.base_url, "model": target.model, "max_model_len": target.max_model_len,
              "scale": args.scale, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{len(names) - len(failed)} of {len(names)} cases passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
