"""Scheduler stats from several data-parallel replicas: /server_info's sums and per-replica
entries, and /metrics' per-replica gauges."""

from __future__ import annotations

from aerie.messages import SchedulerStats
from tokenizer_proc.metrics import Metrics, combine_stats


def report(replica: int, running: int, accepted: list[int], kv_used: int) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=1,
        kv_used_tokens=kv_used,
        kv_total_tokens=100,
        avg_accept_length=sum(accepted) / accepted[0],
        accepted_per_position=accepted,
        num_retractions=replica,
        num_requests=10 * (replica + 1),
        replica=replica,
        num_decode_steps=100 * (replica + 1),
    )


def test_replicas_combine_into_sums_and_the_accept_length_of_all_verify_steps():
    # Replica 0: 10 verify steps, 25 tokens (2.5); replica 1: 30 steps, 45 tokens (1.5).
    a, b = report(0, 2, [10, 8, 7], 40), report(1, 3, [30, 10, 5], 10)
    total = combine_stats([a, b])
    assert (total.num_running, total.num_waiting, total.kv_used_tokens) == (5, 2, 50)
    assert total.kv_total_tokens == 200 and total.num_requests == 30
    assert total.num_decode_steps == 300
    assert total.accepted_per_position == [40, 18, 12]
    assert total.avg_accept_length == 70 / 40  # not the mean of 2.5 and 1.5
    assert combine_stats([a]) is a


def test_server_info_and_metrics_show_each_replica():
    metrics = Metrics()
    metrics.observe_stats(report(1, 3, [30, 10, 5], 10))
    info = metrics.live_stats(kv_total_tokens=100, num_replicas=2)
    # Replica 0 has not reported yet: an idle engine's values.
    assert [r["num_running"] for r in info["replicas"]] == [0, 3]
    assert [r["replica"] for r in info["replicas"]] == [0, 1]
    assert info["num_running"] == 3 and info["kv_total_tokens"] == 200
    metrics.observe_stats(report(0, 2, [10, 8, 7], 40))
    text = metrics.render().decode()
    assert 'aerie_replica_num_running_requests{replica="0"} 2.0' in text
    assert 'aerie_replica_kv_cache_usage{replica="0"} 0.4' in text
    assert "aerie_num_running_requests 5.0" in text
    assert "aerie_decode_steps_total 300.0" in text  # the replicas' steps, summed
    assert info["num_decode_steps"] == 200  # replica 1 alone: 0 has not reported
