"""Prometheus metrics (`/metrics`). Names take vLLM's, with the `tandem:` prefix.

Two sources: what the front end sees per request (counters and latency histograms, updated as
token deltas arrive), and each engine core's stats snapshot that comes with every step's outputs
(running / waiting requests, KV pages, speculative counters), exported as it last arrived.

Replicas (data parallelism): every engine-side series carries a `replica` label (also with one
replica, so dashboards need not change with `--dp-size`); summing over it gives the deployment's
total, except `spec_decode_mean_accept_length`, a per-replica mean (the overall one is
1 + sum(accepted tokens) / sum(drafts)). The front end's own counters and histograms count every
request once, whichever replica ran it, and have no replica label.

Inter-token latency: a step that brings k tokens (speculative decoding) after a gap dt counts as
k observations of dt / k, so the histogram's count is the number of tokens after the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tandem.engine.ipc import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class ReplicaStatus:
    """What the front end knows of one replica at scrape time."""

    index: int
    alive: bool
    stats: EngineStats | None  # the core's last snapshot (None before the first)
    in_flight: int  # engine requests routed to it, not finished or aborted
    routed: int  # engine requests routed to it since the server started


class ServerMetrics:
    def __init__(self, replicas: Callable[[], list[ReplicaStatus]], speculative: bool):
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
        r.register(_EngineCollector(replicas, speculative))

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
    """Exports each replica's latest stats snapshot at scrape time, labelled by replica."""

    def __init__(self, replicas: Callable[[], list[ReplicaStatus]], speculative: bool):
        self.replicas = replicas
        self.speculative = speculative

    def collect(self):
        replicas = self.replicas()
        # A dead engine core runs nothing and holds no pages: its last snapshot would be stale forever.
        stats = [(str(r.index), r.stats if r.alive and r.stats else EngineStats()) for r in replicas]

        def per_replica(family, value):
            for r, (label, s) in zip(replicas, stats):
                family.add_metric([label], value(r, s))
            return family

        def gauge(name, doc, value):
            return per_replica(GaugeMetricFamily(name, doc, labels=["replica"]), value)

        def counter(name, doc, value):
            return per_replica(CounterMetricFamily(name, doc, labels=["replica"]), value)

        yield gauge("tandem:engine_core_up", "1 while the replica's engine core process runs",
                    lambda r, s: int(r.alive))
        yield counter("tandem:engine_core_failures", "Times the replica's engine core died (it is not restarted)",
                      lambda r, s: int(not r.alive))
        yield gauge("tandem:num_requests_running", "Requests in the engine's running batch", lambda r, s: s.num_running)
        yield gauge("tandem:num_requests_waiting", "Requests waiting in the engine's queue", lambda r, s: s.num_waiting)
        yield gauge("tandem:kv_pages_used", "KV cache pages in use", lambda r, s: s.kv_pages_used)
        yield gauge("tandem:kv_pages_total", "KV cache pages in the pool", lambda r, s: s.kv_pages_total)
        yield gauge("tandem:kv_pages_cached", "KV cache pages no request holds, kept by the prefix cache",
                    lambda r, s: s.kv_pages_cached)
        yield counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      lambda r, s: s.prefix_cache_queries)
        yield counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      lambda r, s: s.prefix_cache_hits)
        yield gauge("tandem:replica_requests_in_flight",
                    "Engine requests routed to the replica and not finished (what routing balances)",
                    lambda r, s: r.in_flight)
        yield counter("tandem:replica_requests_routed", "Engine requests routed to the replica",
                      lambda r, s: r.routed)
        if not self.speculative:
            return
        for name, doc, field in (
            ("num_drafts", "Verify steps", "num_drafts"),
            ("num_draft_tokens", "Draft tokens proposed", "num_draft_tokens"),
            ("num_accepted_tokens", "Draft tokens accepted", "num_accepted_tokens"),
            ("catch_ups", "Steps that first ran the draft over the tokens depth-0 steps deferred", "catch_ups"),
            ("dormant_requests", "Requests admitted without draft state (adaptive: drafting did not pay)",
             "dormant_admitted"),
        ):
            yield counter(f"tandem:spec_decode_{name}", doc,
                          lambda r, s, field=field: getattr(s.spec, field) if s.spec else 0)
        def per_position(family, name, doc, values):
            metric = family(name, doc, labels=["replica", "position"])
            for label, s in stats:
                for pos, value in enumerate(values(s.spec) if s.spec else []):
                    metric.add_metric([label, str(pos)], value)
            return metric

        yield per_position(CounterMetricFamily, "tandem:spec_decode_num_accepted_tokens_per_pos",
                           "Draft tokens accepted, by draft position (0 = first)",
                           lambda spec: spec.accepted_per_position)
        yield gauge("tandem:spec_decode_mean_accept_length",
                    "Mean tokens per verify step (accepted drafts + 1) since the replica started",
                    lambda r, s: s.spec.mean_accept_length if s.spec else 0.0)
        depth = HistogramMetricFamily("tandem:spec_decode_draft_depth",
                                      "Draft depth the adaptive policy chose, per engine step (0: no draft)",
                                      labels=["replica"])
        for label, s in stats:
            counts = s.spec.steps_by_depth if s.spec else []
            buckets = [(str(d), float(sum(counts[:d + 1]))) for d in range(len(counts))] + [("+Inf", float(sum(counts)))]
            depth.add_metric([label], buckets, float(sum(d * c for d, c in enumerate(counts))))
        yield depth
        yield per_position(GaugeMetricFamily, "tandem:spec_decode_estimated_acceptance",
                           "The adaptive policy's acceptance rate of each draft position given the one "
                           "before it (0 = first), a moving average over recent verify steps",
                           lambda spec: spec.estimated_acceptance)
