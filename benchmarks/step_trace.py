"""Where an offline run's time goes, step by step, against each step's own roofline.

`StepTrace.install(engine)` records every scheduled step (its rows, tokens, prefill tokens and the
context the attention reads) and the wall time of every `engine.step()` call. The engine runs one step
ahead: call k launches step k and then waits for step k-1's sampled ids, so when the device is the
bottleneck, call k's duration is step k-1's device time; it is attributed to step k-1.

Each step's roofline is the larger of
  bytes: weights + K/V of every token its attention reads, at the measured copy rate, and
  FLOPs: 2 x parameters x the padded token bucket, at the measured bf16 matmul rate,
so a step's efficiency is roofline / measured, and the summary groups the steps by kind and batch size.
Beside it, the step's two passes one after the other, as a step runs them: its matmuls (the larger of the
weights' bytes and 2 x parameters x its real tokens) and its attention (the K/V bytes); and what the
bucket's padded tokens add to the matmuls (`padding`: the FLOPs of bucket - tokens rows where they make the
matmuls compute-bound), the share of a step a finer bucket could give back.
"""
from __future__ import annotations

import time

DECODE_BINS = (1, 8, 32, 64, 128, 256, 1 << 30)


class StepTrace:
    def __init__(self):
        self.plans: list[dict] = []
        self.call_seconds: list[float] = []

    def install(self, engine) -> "StepTrace":
        schedule, step, buckets = engine.scheduler.schedule, engine.step, engine.runner.buckets

        def traced_schedule():
            plan = schedule()
            if plan.rows:
                tokens = plan.num_tokens
                self.plans.append(dict(
                    rows=len(plan.rows), tokens=tokens, bucket=next((b for b in buckets if b >= tokens), tokens),
                    prefill_tokens=sum(r.num_tokens for r in plan.rows if r.num_tokens > 1),
                    context_tokens=sum(r.start + r.num_tokens for r in plan.rows)))
            else:
                self.plans.append(None)
            return plan

        def traced_step():
            t = time.perf_counter()
            out = step()
            self.call_seconds.append(time.perf_counter() - t)
            return out

        engine.scheduler.schedule, engine.step = traced_schedule, traced_step
        return self

    def steps(self) -> list[dict]:
        """The launched steps with `seconds`: the duration of the call after the one that launched it."""
        out = []
        for k, plan in enumerate(self.plans):
            if plan is not None and k + 1 < len(self.call_seconds):
                out.append({**plan, "seconds": self.call_seconds[k + 1]})
        return out

    def summary(self, *, weight_bytes: int, kv_bytes_per_token: int, num_params: int, copy_bytes_per_s: float,
                matmul_flops_per_s: float) -> list[dict]:
        def matmuls(tokens: int) -> float:  # the weights read once, or their FLOPs over `tokens` rows
            return max(weight_bytes / copy_bytes_per_s, 2.0 * num_params * tokens / matmul_flops_per_s)

        groups: dict[str, dict] = {}
        for s in self.steps():
            kv_s = kv_bytes_per_token * s["context_tokens"] / copy_bytes_per_s
            roof = max(weight_bytes / copy_bytes_per_s + kv_s, 2.0 * num_params * s["bucket"] / matmul_flops_per_s)
            if s["prefill_tokens"]:
                name = "with prefill"
            else:
                lo = max(b for b in DECODE_BINS if b < s["rows"]) if s["rows"] > 1 else 0
                hi = min(b for b in DECODE_BINS if b >= s["rows"])
                name = f"decode {lo + 1}-{hi} seqs"
            g = groups.setdefault(name, dict(group=name, steps=0, seconds=0.0, roofline_s=0.0, passes_s=0.0, padding_s=0.0,
                                             rows=0, context_tokens=0))
            g["steps"] += 1
            g["seconds"] += s["seconds"]
            g["roofline_s"] += roof
            g["passes_s"] += matmuls(s["tokens"]) + kv_s
            g["padding_s"] += matmuls(s["bucket"]) - matmuls(s["tokens"])
            g["rows"] += s["rows"]
            g["context_tokens"] += s["context_tokens"]
        order = sorted(groups.values(), key=lambda g: (g["group"] != "with prefill", _first_number(g["group"])))
        for g in order:
            g["ms_per_step"] = g["seconds"] / g["steps"] * 1e3
            g["roofline_ms_per_step"] = g["roofline_s"] / g["steps"] * 1e3
            g["passes_ms_per_step"] = g["passes_s"] / g["steps"] * 1e3
            g["padding_ms_per_step"] = g["padding_s"] / g["steps"] * 1e3
            g["efficiency"] = g["roofline_s"] / g["seconds"] if g["seconds"] else float("nan")
            g["mean_rows"] = g["rows"] / g["steps"]
            g["mean_context"] = g["context_tokens"] / max(g["rows"], 1)
        return order


def _first_number(name: str) -> int:
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return int(digits[0]) if digits else 0


def format_summary(groups: list[dict]) -> str:
    lines = ["| steps | kind | mean seqs | mean context | ms/step | roofline ms/step | efficiency | share of time "
             "| matmuls + attention ms/step | padding ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    total = sum(g["seconds"] for g in groups) or 1.0
    for g in groups:
        lines.append(f"| {g['steps']} | {g['group']} | {g['mean_rows']:.0f} | {g['mean_context']:.0f} | {g['ms_per_step']:.2f} "
                     f"| {g['roofline_ms_per_step']:.2f} | {g['efficiency']:.0%} | {g['seconds'] / total:.0%} "
                     f"| {g['passes_ms_per_step']:.2f} | {g['padding_ms_per_step']:.2f} |")
    return "\n".join(lines)
