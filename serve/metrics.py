"""Server metrics in the Prometheus text format (version 0.0.4), names prefixed `jlight:`
like vLLM's `vllm:`.

Written by hand rather than with prometheus_client, which is not a declared dependency
of jlight; the format is small. Latency histograms are recorded by the server as
requests flow; engine gauges and counters are read from EngineStats when scraped. The
server process's resident memory is `process_resident_memory_bytes`, the name Prometheus'
own process collector gives it (unprefixed, so dashboards find it), where /proc has it.
"""
from __future__ import annotations

import bisect
import math
import os
import sys
import threading

PREFIX = "jlight:"
RSS_METRIC = "process_resident_memory_bytes"
# What of it Python's own allocator holds, in blocks (objects and their buffers; native allocations, a GPU
# runtime's host buffers among them, are not counted): tells growth of the one from growth of the other.
PY_BLOCKS_METRIC = "jlight:python_allocated_blocks"

# Seconds. Like vLLM's buckets: fine near the typical values, coarse in the tail.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)

# How a request ended, as counted by jlight:request_total{outcome=...}.
OUTCOMES = ("stop", "length", "abort", "client_disconnect", "invalid", "overloaded", "error")


def _fmt(value: float) -> str:
    value = float(value)
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: above the largest bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets + (math.inf,), self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


def _metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    """`samples` are (label text like '{outcome="stop"}' or '', value)."""
    full = PREFIX + name
    lines = [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{labels} {_fmt(value)}" for labels, value in samples]
    return lines


class ServerMetrics:
    """Everything the server counts itself. Updated from the event loop; a lock keeps a
    scrape from reading a histogram half-updated if a handler runs in a thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between a request's successive engine outputs.", ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.http_requests = 0

    def record_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def record_finished(self, outcome: str, e2e_seconds: float | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            if e2e_seconds is not None:
                self.e2e.observe(e2e_seconds)

    def render(self, engine_stats=None) -> str:
        """The /metrics page; `engine_stats` is an EngineStats (or None before the engine runs)."""
        with self._lock:
            lines = _metric("request_total", "counter", "Requests by how they ended.",
                            [(f'{{outcome="{k}"}}', v) for k, v in self.outcomes.items()])
            for hist in (self.ttft, self.itl, self.e2e):
                lines += hist.render()
        if engine_stats is not None:
            lines += _engine_lines(engine_stats)
        rss = resident_memory_bytes()
        if rss is not None:
            lines += [f"# HELP {RSS_METRIC} Resident memory size in bytes.", f"# TYPE {RSS_METRIC} gauge",
                      f"{RSS_METRIC} {rss}"]
        lines += [f"# HELP {PY_BLOCKS_METRIC} Memory blocks Python's allocator holds (sys.getallocatedblocks).",
                  f"# TYPE {PY_BLOCKS_METRIC} gauge", f"{PY_BLOCKS_METRIC} {sys.getallocatedblocks()}"]
        return "\n".join(lines) + "\n"


def resident_memory_bytes() -> int | None:
    """This process's resident set (Linux's /proc/self/statm), or None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _engine_lines(s) -> list[str]:
    queried = s.prefix_cache_query_tokens
    hit_rate = s.prefix_cache_hit_tokens / queried if queried else 0.0
    used_fraction = s.num_pages_used / s.num_pages_total if s.num_pages_total else 0.0
    return (
        _metric("num_requests_running", "gauge", "Requests in the running batch.", [("", s.num_running)])
        + _metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", [("", s.num_waiting)])
        + _metric("kv_cache_pages_used", "gauge", "KV cache pages in use.", [("", s.num_pages_used)])
        + _metric("kv_cache_pages_total", "gauge", "KV cache pages in the pool.", [("", s.num_pages_total)])
        + _metric("kv_cache_usage_perc", "gauge", "Fraction of KV cache pages in use (0-1).", [("", used_fraction)])
        + _metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", [("", queried)])
        + _metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", [("", s.prefix_cache_hit_tokens)])
        + _metric("prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries since start (0-1).", [("", hit_rate)])
        + _metric("prefix_cache_tier_hits_total", "counter",
                  "Prompt tokens admitted sequences took from cached pages, by tier (re-admissions too).",
                  [('{tier="device"}', s.device_cache_hit_tokens), ('{tier="host"}', s.host_cache_hit_tokens)])
        + _metric("host_kv_cache_offloaded_pages_total", "counter", "Evicted KV pages copied to the host tier.",
                  [("", s.host_cache_offloaded_pages)])
        + _metric("host_kv_cache_dropped_pages_total", "counter", "KV pages the host tier dropped (LRU) for room.",
                  [("", s.host_cache_dropped_pages)])
        + _metric("host_kv_cache_pages_used", "gauge", "KV pages held in the host tier.", [("", s.host_cache_pages_used)])
        + _metric("host_kv_cache_pages_capacity", "gauge", "KV pages the host tier can hold (0: no tier).",
                  [("", s.host_cache_pages_total)])
        + _metric("num_preemptions_total", "counter", "Requests preempted to free KV pages.", [("", s.num_preemptions)])
        + _metric("kv_transfers_total", "counter",
                  "Disaggregated prefill/decode handoffs: pages received (decode side), recomputed because they could "
                  "not come (decode side), sent (prefill side).",
                  [('{outcome="received"}', s.kv_transfers_received), ('{outcome="failed"}', s.kv_transfers_failed),
                   ('{outcome="sent"}', s.kv_transfers_sent)])
        + _metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", s.prompt_tokens_total)])
        + _metric("generation_tokens_total", "counter", "Tokens generated.", [("", s.generation_tokens_total)])
        + _spec_lines(s)
    )


def _spec_lines(s) -> list[str]:
    """Speculative decoding's counters under vLLM's names: verified rows, drafts proposed and kept,
    kept drafts per draft position."""
    per_pos = [(f'{{position="{i}"}}', n) for i, n in enumerate(s.spec_accepted_per_position)]
    return (
        _metric("spec_decode_num_drafts_total", "counter", "Rows that verified drafts.", [("", s.spec_num_drafts)])
        + _metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", s.spec_num_draft_tokens)])
        + _metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", s.spec_num_accepted_tokens)])
        + (_metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted at each draft position.",
                   per_pos) if per_pos else [])
    )


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; for tests and the benchmark client."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
