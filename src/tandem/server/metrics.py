"""Prometheus metrics (`/metrics`). Names take vLLM's, with the `tandem:` prefix.

Two sources: what the front end sees per request (counters and latency histograms, updated as
token deltas arrive), and the engine core's stats snapshot that comes with every step's outputs
(running / waiting requests, KV pages, speculative counters), exported as it last arrived.

Inter-token latency: a step that brings k tokens (speculative decoding) after a gap dt counts as
k observations of dt / k, so the histogram's count is the number of tokens after the first.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.engine.ipc import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None], engine_alive: Callable[[], bool],
                 speculative: bool):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_finished = Counter("tandem:requests_finished", "Finished engine requests (one per choice)",
                                         ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)  # export zeros from the start
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens sent to the engine", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram("tandem:time_to_first_token_seconds", "Time to first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("tandem:inter_token_latency_seconds", "Time between tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("tandem:e2e_request_latency_seconds", "Arrival to last token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats, engine_alive, speculative))

    def on_tokens(self, num_tokens: int, arrival: float, first: float | None, last: float | None,
                  now: float) -> None:
        """A delta of `num_tokens` arrived at `now`; first/last: when earlier tokens came (or None)."""
        self.generation_tokens.inc(num_tokens)
        if first is None:
            self.time_to_first_token.observe(now - arrival)
            num_tokens -= 1
        if num_tokens > 0 and last is not None:
            gap = (now - last) / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(gap)

    def on_finished(self, reason: str, arrival: float, now: float) -> None:
        self.requests_finished.labels(reason).inc()
        self.e2e_latency.observe(now - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Exports the engine core's latest stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], alive: Callable[[], bool], speculative: bool):
        self.stats = stats
        self.alive = alive
        self.speculative = speculative

    def collect(self):
        s = self.stats() or EngineStats()
        yield _gauge("tandem:engine_core_up", "1 while the engine core process runs", int(self.alive()))
        yield _gauge("tandem:num_requests_running", "Requests in the engine's running batch", s.num_running)
        yield _gauge("tandem:num_requests_waiting", "Requests waiting in the engine's queue", s.num_waiting)
        yield _gauge("tandem:kv_pages_used", "KV cache pages in use", s.kv_pages_used)
        yield _gauge("tandem:kv_pages_total", "KV cache pages in the pool", s.kv_pages_total)
        if not self.speculative:
            return
        spec = s.spec
        for name, doc, value in (
            ("num_drafts", "Verify steps", spec.num_drafts if spec else 0),
            ("num_draft_tokens", "Draft tokens proposed", spec.num_draft_tokens if spec else 0),
            ("num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens if spec else 0),
        ):
            yield CounterMetricFamily(f"tandem:spec_decode_{name}", doc, value=value)
        per_pos = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position (0 = first)", labels=["position"])
        for pos, count in enumerate(spec.accepted_per_position if spec else []):
            per_pos.add_metric([str(pos)], count)
        yield per_pos
        yield _gauge("tandem:spec_decode_mean_accept_length",
                     "Mean tokens per verify step (accepted drafts + 1) since start",
                     spec.mean_accept_length if spec else 0.0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
