"""Serving benchmark: load an OpenAI-compatible server the way vLLM's benchmark_serving does.

Requests arrive as a Poisson process at each given rate (or all at once for `inf`),
optionally capped at a concurrency; every request streams from /v1/completions, and the
client records per request:
  TTFT  time to first token (first non-empty text chunk),
  ITL   the gaps between successive chunks,
  TPOT  (e2e - TTFT) / (output tokens - 1), the mean time per output token after the first,
  E2EL  end-to-end latency.
Output token counts come from the server's `usage` (stream_options.include_usage).

Datasets: `random` (random token ids of --input-len / --output-len, +-range-ratio, sent as
token-id prompts with ignore_eos so the lengths hold) or `sharegpt` (a ShareGPT-format JSON
file; the first human turn is the prompt, the reply's token count the output length, both
counted with the server's /tokenize).

Each rate gets its own prompts (and the warm-up its own), so a rate never finds its prompts
in the server's prefix cache from an earlier rate; a ShareGPT file too small for that reuses
one set for every rate, and the report says so (`prompts_reused_across_rates`).

Writes a JSON with every rate's summary (rewritten after each rate, so a run cut short keeps
the rates it finished), and a PNG of latency percentiles vs request rate when matplotlib is
installed.

    jlight bench serve --base-url http://127.0.0.1:8000 --request-rates 1,4,16,inf \
        --num-prompts 200 --input-len 256 --output-len 128 --out results/serving
    (or: python benchmarks/serving.py ..., the same thing)
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import time

import httpx
import numpy as np

from jlight.serve.defaults import CLIENT_KEEPALIVE_EXPIRY_S
from jlight.serve.metrics import parse_metrics


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


# ---- datasets ---------------------------------------------------------------------------

def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)

    def around(n):
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))
    requests = []
    for _ in range(num):
        in_len, out_len = around(input_len), around(output_len)
        # Skip the first 100 ids, where tokenizers keep special and control tokens.
        prompt = [rng.randrange(100, vocab_size) for _ in range(in_len)]
        requests.append(BenchRequest(prompt, in_len, out_len))
    return requests


def sharegpt_requests(path: str, num: int, client: httpx.Client, seed: int,
                      max_prompt_len: int = 1024, max_total_len: int = 2048,
                      at_least: int | None = None) -> list[BenchRequest]:
    """Up to `num` conversations with a human turn followed by a reply, filtered like vLLM's
    (prompt >= 4 tokens, reply >= 4, prompt <= 1024, prompt + reply <= 2048); ValueError when
    fewer than `at_least` (default `num`) are usable."""
    with open(path) as f:
        data = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(pairs)

    def count(text):
        r = client.post("/tokenize", json={"prompt": text})
        r.raise_for_status()
        return r.json()["count"]
    requests = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        if not prompt:
            continue
        prompt_len, out_len = count(prompt), count(reply)
        if prompt_len < 4 or out_len < 4 or prompt_len > max_prompt_len or prompt_len + out_len > max_total_len:
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
    if len(requests) < (num if at_least is None else at_least):
        raise ValueError(f"{path} holds only {len(requests)} usable conversations; lower --num-prompts")
    return requests


def split_requests(pool: list[BenchRequest], num: int, num_rates: int,
                   warmup: int) -> tuple[list[BenchRequest], list[list[BenchRequest]], bool]:
    """(warm-up requests, one list of `num` per rate, reused): distinct prompts for the warm-up
    and for each rate when the pool holds enough, else the first `num` for every rate."""
    if len(pool) >= warmup + num * num_rates:
        rest = pool[warmup:]
        return pool[:warmup], [rest[i * num:(i + 1) * num] for i in range(num_rates)], False
    return pool[:warmup], [pool[:num]] * num_rates, True


# ---- one request --------------------------------------------------------------------------

async def send_request(client: httpx.AsyncClient, model: str | None, req: BenchRequest,
                       ignore_eos: bool) -> RequestResult:
    body = {"prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if model:
        body["model"] = model
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.ttft > 0.0
        if not result.ok:
            result.error = "no text came back"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# ---- one rate ----------------------------------------------------------------------------

async def run_at_rate(base_url: str, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
                      model: str | None, api_key: str | None, ignore_eos: bool, seed: int) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests), max_keepalive_connections=None,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = np.random.default_rng(seed)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30)) as client:
        async def one(req):
            if semaphore is None:
                return await send_request(client, model, req, ignore_eos)
            async with semaphore:
                return await send_request(client, model, req, ignore_eos)
        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if rate != math.inf:
                await asyncio.sleep(rng.exponential(1.0 / rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate, max_concurrency)


def _stats_ms(name: str, values: list[float]) -> dict:
    arr = np.asarray(values, dtype=np.float64) * 1000 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, rate: float, max_concurrency: int | None) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "request_rate": "inf" if rate == math.inf else rate,
        "max_concurrency": max_concurrency,
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    summary.update(_stats_ms("ttft", [r.ttft for r in done]))
    summary.update(_stats_ms("tpot", tpots))
    summary.update(_stats_ms("itl", [gap for r in done for gap in r.itl]))
    summary.update(_stats_ms("e2el", [r.e2e for r in done]))
    return summary


# ---- output -------------------------------------------------------------------------------

def plot(summaries: list[dict], path: str) -> bool:
    """Latency percentiles vs request rate; False when matplotlib is not installed."""
    try:
        # matplotlib (optional) loads only for plots.
        import matplotlib
        matplotlib.use("Agg")
        # matplotlib (optional) loads only for plots.
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    finite = [s for s in summaries if s["request_rate"] != "inf"]
    burst = next((s for s in summaries if s["request_rate"] == "inf"), None)  # all at once: no x position
    rates = [s["request_rate"] for s in finite]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2el")):
        for stat, color in (("median", "tab:blue"), ("p99", "tab:orange")):
            ax.plot(rates, [s[f"{stat}_{metric}_ms"] for s in finite], marker="o", color=color, label=stat)
            if burst is not None:
                ax.axhline(burst[f"{stat}_{metric}_ms"], color=color, linestyle="--", label=f"{stat}, all at once")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def print_summary(s: dict) -> None:
    print(f"--- rate {s['request_rate']} req/s: {s['completed']} ok, {s['failed']} failed, {s['duration_s']:.1f} s")
    print(f"    throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s")
    for m in ("ttft", "tpot", "itl", "e2el"):
        print(f"    {m.upper():5s} mean {s[f'mean_{m}_ms']:9.1f}  median {s[f'median_{m}_ms']:9.1f}  "
              f"p99 {s[f'p99_{m}_ms']:9.1f} ms")
    if s["errors"]:
        print(f"    errors: {s['errors']}")
    spec = s.get("spec_decode")
    if spec and spec["num_drafts"]:
        print(f"    speculative decoding: {spec['num_draft_tokens']:.0f} drafted, {spec['num_accepted_tokens']:.0f} accepted "
              f"({spec['acceptance_rate']:.1%}), mean acceptance length {spec['mean_acceptance_length']:.2f}")


SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")


def spec_counters(client: httpx.Client) -> dict | None:
    """The server's speculative-decoding counters from /metrics (jlight's names, or vLLM's: the same after
    the prefix), or None where it has none."""
    try:
        text = client.get("/metrics").text
    except httpx.HTTPError:
        return None
    found = {name.split(":", 1)[-1]: value for name, value in parse_metrics(text).items()
             if name.split(":", 1)[-1] in SPEC_COUNTERS}
    return found if len(found) == len(SPEC_COUNTERS) else None


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """What one rate's requests verified: drafts, acceptance rate (accepted / drafted tokens) and vLLM's
    mean acceptance length (1 + accepted tokens / verifies: the tokens a verifying step adds)."""
    if before is None or after is None:
        return None
    verifies, drafted, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
    return {"num_drafts": verifies, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / verifies if verifies else None}


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        rate = math.inf if part.strip() == "inf" else float(part)
        if rate <= 0:
            raise argparse.ArgumentTypeError(f"request rate {part!r} must be > 0 or 'inf'")
        rates.append(rate)
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (for --dataset sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random lengths vary by +- this fraction")
    parser.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    parser.add_argument("--request-rates", type=parse_rates, default=[math.inf],
                        help="comma-separated requests/s, 'inf' = all at once (e.g. 1,4,16,inf)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=2, help="sent before measuring (compiles, caches)")
    parser.add_argument("--out", default="serving_benchmark", help="writes OUT.json and OUT.png")


def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    wanted = args.warmup_requests + args.num_prompts * len(args.request_rates)
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=60) as client:
        model = args.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        if args.dataset == "sharegpt":
            if not args.dataset_path:
                raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
            pool = sharegpt_requests(args.dataset_path, wanted, client, args.seed, at_least=args.num_prompts)
        else:
            pool = random_requests(wanted, args.input_len, args.output_len, args.range_ratio,
                                   args.vocab_size, args.seed)
    warmup, per_rate, reused = split_requests(pool, args.num_prompts, len(args.request_rates), args.warmup_requests)
    if reused:
        print(f"note: {len(pool)} prompts are too few for distinct sets per rate; every rate sends the same "
              f"{args.num_prompts}, so later rates may find them in the server's prefix cache")
    ignore_eos = args.dataset == "random"
    if warmup:
        asyncio.run(run_at_rate(args.base_url, warmup, math.inf, None, model, args.api_key, ignore_eos, args.seed))
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "base_url": args.base_url, "model": model,
              "dataset": args.dataset, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "range_ratio": args.range_ratio,
              "max_concurrency": args.max_concurrency, "prompts_reused_across_rates": reused, "results": []}
    metrics_client = httpx.Client(base_url=args.base_url, headers=headers, timeout=60)
    for rate, requests in zip(args.request_rates, per_rate):
        before = spec_counters(metrics_client)
        s = asyncio.run(run_at_rate(args.base_url, requests, rate, args.max_concurrency, model, args.api_key,
                                    ignore_eos, args.seed))
        s["spec_decode"] = spec_summary(before, spec_counters(metrics_client))
        print_summary(s)
        report["results"].append(s)
        with open(args.out + ".json", "w") as f:  # after every rate: a run cut short keeps what it measured
            json.dump(report, f, indent=2)
    metrics_client.close()
    wrote_png = plot(report["results"], args.out + ".png")
    print(f"wrote {args.out}.json" + (f" and {args.out}.png" if wrote_png else " (no PNG: matplotlib is not installed)"))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jlight bench serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
