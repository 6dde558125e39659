"""Prometheus metrics and the live scheduler stats served by /metrics and /server_info.

`Metrics` owns its own `CollectorRegistry` (several apps in one test process never collide).
The request tracker calls `observe_first_output` / `observe_finish`; the process calls
`observe_stats` for each `SchedulerStats`. Metric names are prefixed `aerie_`. With several
data-parallel replicas the gauges and counters are the sums over them, and the
`aerie_replica_*` gauges (label `replica`) give each one's.

With several frontends each counts its own requests (finishes, tokens, latencies) and shares a
`snapshot` of those counts with the others about once a second (`observe_peer`): whichever
frontend a scrape reaches reports the sums over all of them, the others' up to a second old.
What the schedulers report reaches every frontend alike and is not summed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from aerie.endpoints import frontend_name
from aerie.messages import FrontendMetrics, SchedulerStats
from tokenizer_proc.request_tracker import RequestState

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, frontend: int = 0) -> None:
        """frontend: this frontend's index among several (`--tokenizer-worker-num`)."""
        self.frontend = frontend
        self.registry = CollectorRegistry()
        # This frontend's own request counts, exported summed with the other frontends'.
        self.own = CollectorRegistry()
        self.peers: dict[int, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        own = self.own
        self.requests = Counter(
            "aerie_requests", "Finished requests by finish type.", ["finish_type"], registry=own
        )
        self.prompt_tokens = Counter("aerie_prompt_tokens", "Prompt tokens.", registry=own)
        self.generation_tokens = Counter(
            "aerie_generation_tokens", "Generated tokens.", registry=own
        )
        r = self.registry
        self.num_running = Gauge("aerie_num_running_requests", "Requests running.", registry=r)
        self.num_queued = Gauge("aerie_num_queued_requests", "Requests waiting.", registry=r)
        self.kv_usage = Gauge("aerie_kv_usage_ratio", "Used / total KV tokens.", registry=r)
        self.accept_length = Gauge(
            "aerie_avg_accept_length", "Average speculative accept length.", registry=r
        )
        self.cache_tokens = Gauge(
            "aerie_prefix_cache_tokens", "Tokens of KV the prefix cache holds.", registry=r
        )
        self.cache_evictable = Gauge(
            "aerie_prefix_cache_evictable_tokens",
            "Of them, tokens no running request uses (freed as new requests need KV).",
            registry=r,
        )
        self.cache_hit_rate = Gauge(
            "aerie_prefix_cache_hit_rate",
            "Prompt tokens reused from the prefix cache over prompt tokens admitted, since start.",
            registry=r,
        )
        self.speculating = Gauge(
            "aerie_spec_speculating",
            "Adaptive speculation's last decode step: 1 an iteration, 0 plain decoding.",
            registry=r,
        )
        self.expected_accept = Gauge(
            "aerie_spec_expected_accept_length",
            "Tokens per iteration adaptive speculation expected of the last decode batch.",
            registry=r,
        )
        self.expected_error = Gauge(
            "aerie_spec_expected_accept_error",
            "The standard error of that expectation: the decode step speculated when the "
            "expectation plus it reached the break-even.",
            registry=r,
        )
        self.break_even = Gauge(
            "aerie_spec_break_even_accept_length",
            "Tokens per iteration at which an iteration would match plain decoding for the "
            "last decode batch (measured step costs).",
            registry=r,
        )
        self.ttft = Histogram(
            "aerie_time_to_first_token_seconds",
            "Time from arrival to the first output.",
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.e2e = Histogram(
            "aerie_e2e_request_latency_seconds",
            "Time from arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        labels = ["replica"]
        self.replica_running = Gauge(
            "aerie_replica_num_running_requests",
            "Requests running, per replica.",
            labels,
            registry=r,
        )
        self.replica_queued = Gauge(
            "aerie_replica_num_queued_requests",
            "Requests waiting, per replica.",
            labels,
            registry=r,
        )
        self.replica_kv_usage = Gauge(
            "aerie_replica_kv_cache_usage",
            "Fraction of KV slots in use, per replica.",
            labels,
            registry=r,
        )
        self.replica_stats: dict[int, SchedulerStats] = {}  # each replica's last report
        self.last_stats: SchedulerStats | None = None  # their sum
        r.register(SchedulerTotals(self))
        r.register(FrontendTotals(self))

    def observe_first_output(self, state: RequestState) -> None:
        ttft = state.ttft()
        if ttft is not None:
            self.ttft.observe(ttft)

    def observe_finish(self, state: RequestState) -> None:
        finish_type = state.finish.type if state.finish else "abort"
        self.requests.labels(finish_type=finish_type).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.e2e.observe(state.e2e_latency())

    def observe_stats(self, report: SchedulerStats) -> None:
        self.replica_stats[report.replica] = report
        replica = str(report.replica)
        self.replica_running.labels(replica=replica).set(report.num_running)
        self.replica_queued.labels(replica=replica).set(report.num_waiting)
        self.replica_kv_usage.labels(replica=replica).set(kv_usage(report))
        stats = self.last_stats = combine_stats(list(self.replica_stats.values()))
        self.num_running.set(stats.num_running)
        self.num_queued.set(stats.num_waiting)
        self.kv_usage.set(kv_usage(stats))
        self.accept_length.set(stats.avg_accept_length)
        self.cache_tokens.set(stats.prefix_cache_tokens)
        self.cache_evictable.set(stats.prefix_cache_evictable_tokens)
        self.cache_hit_rate.set(cache_hit_rate(stats))
        if stats.speculating >= 0:
            self.speculating.set(stats.speculating)
            self.expected_accept.set(stats.expected_accept_length)
            self.expected_error.set(stats.expected_accept_error)
            self.break_even.set(stats.break_even_accept_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self, frontend: int) -> FrontendMetrics:
        """This frontend's own counts (frontend: its index), for `observe_peer` in the others."""
        samples = [
            sample
            for family in self.own.collect()
            for sample in family.samples
            if not sample.name.endswith("_created")  # a timestamp: not a count to sum
        ]
        return FrontendMetrics(
            frontend,
            [sample.name for sample in samples],
            [dict(sample.labels) for sample in samples],
            [sample.value for sample in samples],
        )

    def observe_peer(self, snapshot: FrontendMetrics) -> None:
        """Another frontend's latest `snapshot` (its counts so far, not increments)."""
        keys = [
            (n, tuple(sorted(labels.items())))
            for n, labels in zip(snapshot.names, snapshot.labels, strict=True)
        ]
        self.peers[snapshot.frontend] = dict(zip(keys, snapshot.values, strict=True))

    def live_stats(self, kv_total_tokens: int = 0, num_replicas: int = 1) -> dict[str, Any]:
        """The last stats as a dict for /server_info: the sums over the replicas, and under
        "replicas" each one's. Before a replica's first report it shows an idle engine's values
        (kv_total_tokens: the configured capacity of one replica)."""
        idle = SchedulerStats(0, 0, 0, kv_total_tokens, 0.0)
        reports = [
            self.replica_stats.get(i, dataclasses.replace(idle, replica=i))
            for i in range(max(num_replicas, len(self.replica_stats)))
        ]
        return {
            **stats_dict(combine_stats(reports)),
            "replicas": [{"replica": r.replica, **stats_dict(r)} for r in reports],
        }


def stats_dict(s: SchedulerStats) -> dict[str, Any]:
    return {
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "kv_used_tokens": s.kv_used_tokens,
        "kv_total_tokens": s.kv_total_tokens,
        "kv_usage": kv_usage(s),
        "avg_accept_length": s.avg_accept_length,
        "accepted_per_position": list(s.accepted_per_position),
        "num_retractions": s.num_retractions,
        "num_requests": s.num_requests,
        "num_decode_steps": s.num_decode_steps,
        # Prefix cache: prompt tokens admitted and reused since start, what it holds now.
        "prefill_tokens": s.prefill_tokens,
        "cached_prefill_tokens": s.cached_prefill_tokens,
        "prefix_cache_hit_rate": cache_hit_rate(s),
        "prefix_cache_tokens": s.prefix_cache_tokens,
        "prefix_cache_evictable_tokens": s.prefix_cache_evictable_tokens,
        # Adaptive speculation: decode steps run plainly, and the last step's choice and why.
        "spec_plain_steps": s.num_plain_steps,
        "spec_speculating": None if s.speculating < 0 else bool(s.speculating),
        "spec_expected_accept_length": s.expected_accept_length,
        "spec_expected_accept_error": s.expected_accept_error,
        "spec_break_even_accept_length": s.break_even_accept_length,
    }


def combine_stats(reports: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' reports as one: counts summed; the accept length of all verify steps
    together (accepted_per_position[0] counts a replica's verify steps and the sum over
    positions its decoded tokens); adaptive speculation's last choice is each replica's own
    ("replicas" in /server_info), not combined."""
    if len(reports) == 1:
        return reports[0]
    positions = max(len(r.accepted_per_position) for r in reports)
    accepted = [
        sum(r.accepted_per_position[k] for r in reports if k < len(r.accepted_per_position))
        for k in range(positions)
    ]
    return SchedulerStats(
        num_running=sum(r.num_running for r in reports),
        num_waiting=sum(r.num_waiting for r in reports),
        kv_used_tokens=sum(r.kv_used_tokens for r in reports),
        kv_total_tokens=sum(r.kv_total_tokens for r in reports),
        avg_accept_length=sum(accepted) / accepted[0] if accepted and accepted[0] else 0.0,
        accepted_per_position=accepted,
        num_retractions=sum(r.num_retractions for r in reports),
        num_requests=sum(r.num_requests for r in reports),
        num_plain_steps=sum(r.num_plain_steps for r in reports),
        num_decode_steps=sum(r.num_decode_steps for r in reports),
        prefill_tokens=sum(r.prefill_tokens for r in reports),
        cached_prefill_tokens=sum(r.cached_prefill_tokens for r in reports),
        prefix_cache_tokens=sum(r.prefix_cache_tokens for r in reports),
        prefix_cache_evictable_tokens=sum(r.prefix_cache_evictable_tokens for r in reports),
    )


class SchedulerTotals(Collector):
    """The scheduler's cumulative counts, exported as Prometheus counters at scrape time (the
    scheduler owns the totals; SchedulerStats carries them)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.metrics.last_stats
        accepted = CounterMetricFamily(
            "aerie_spec_accepted_tokens",
            "Speculative verify steps that emitted more than `position` tokens: position 0 "
            "counts every verify step, position k >= 1 those whose k-th draft was accepted.",
            labels=["position"],
        )
        retractions = CounterMetricFamily(
            "aerie_retractions", "Requests retracted because the KV cache ran out."
        )
        plain = CounterMetricFamily(
            "aerie_spec_plain_steps",
            "Decode steps a speculative server ran as plain decoding, because adaptive "
            "speculation expected them to be faster for their batch.",
        )
        cached = CounterMetricFamily(
            "aerie_prefix_cache_hit_tokens",
            "Prompt tokens reused from the prefix cache instead of prefilled.",
        )
        decode = CounterMetricFamily(
            "aerie_decode_steps",
            "Decode steps run: plain decode steps and speculative iterations (with the run's "
            "wall time, what a step costs as served).",
        )
        if stats is not None:
            for position, count in enumerate(stats.accepted_per_position):
                accepted.add_metric([str(position)], count)
            retractions.add_metric([], stats.num_retractions)
            plain.add_metric([], stats.num_plain_steps)
            decode.add_metric([], stats.num_decode_steps)
            cached.add_metric([], stats.cached_prefill_tokens)
        yield cached
        yield accepted
        yield retractions
        yield plain
        yield decode


class FrontendTotals(Collector):
    """The frontends' request counts at scrape time: this frontend's own plus the last
    snapshot of each other one, sample by sample (counters and histogram buckets add up)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        peers = list(self.metrics.peers.values())
        for family in self.metrics.own.collect():
            total = Metric(family.name, family.documentation, family.type)
            seen = set()
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen.add(key)
                value = sample.value
                if not sample.name.endswith("_created"):
                    value += sum(peer.get(key, 0.0) for peer in peers)
                total.add_sample(sample.name, sample.labels, value)
            # Labels only other frontends have seen so far (a finish type new here).
            for peer in peers:
                for name, labels in peer:
                    if name.startswith(family.name) and (name, labels) not in seen:
                        seen.add((name, labels))
                        other = sum(p.get((name, labels), 0.0) for p in peers)
                        total.add_sample(name, dict(labels), other)
            yield total
        yield self.per_frontend()

    def per_frontend(self) -> Metric:
        """Finished requests by the frontend that served them: how the kernel spread the
        connections over the frontends."""
        name = "aerie_requests_total"
        counts = {self.metrics.frontend: sum(s.value for s in self._own_samples(name))}
        for index, peer in self.metrics.peers.items():
            counts[index] = sum(value for (sample, _), value in peer.items() if sample == name)
        family = Metric(
            "aerie_frontend_requests",
            "Finished requests by the frontend process that served them.",
            "counter",
        )
        for index in sorted(counts):
            labels = {"frontend": frontend_name(index)}
            family.add_sample("aerie_frontend_requests_total", labels, counts[index])
        return family

    def _own_samples(self, name: str) -> list:
        return [s for f in self.metrics.own.collect() for s in f.samples if s.name == name]


def cache_hit_rate(stats: SchedulerStats) -> float:
    return stats.cached_prefill_tokens / stats.prefill_tokens if stats.prefill_tokens else 0.0


def kv_usage(stats: SchedulerStats) -> float:
    return stats.kv_used_tokens / stats.kv_total_tokens if stats.kv_total_tokens else 0.0
