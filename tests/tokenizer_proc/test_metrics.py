"""Scheduler stats from several data-parallel replicas: /server_info's sums and per-replica
entries, and /metrics' per-replica gauges."""

from __future__ import annotations

from aerie.codec import decode, encode
from aerie.messages import FinishReason, SchedulerStats
from tokenizer_proc.metrics import Metrics, combine_stats
from tokenizer_proc.request_tracker import RequestState


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


def finished(finish: str, prompt: int, completion: int) -> RequestState:
    state = RequestState("r", prompt_tokens=prompt, first_output_at=1.0, created_at=0.5)
    state.finish, state.finished_at = FinishReason(finish), 2.0
    state.completion_tokens = completion
    return state


def sample(text: str, name: str) -> float:
    """The value of the sample line that starts with name (labels included) in text."""
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_each_frontend_reports_the_request_counts_of_all_of_them():
    """Two frontends' Metrics exchange snapshots: each renders the sums of the counters and
    histograms (a finish type only the other has seen included), not its own alone; what the
    schedulers report is not summed."""
    first, second = Metrics(0), Metrics(1)
    for metrics in (first, second):
        metrics.observe_stats(SchedulerStats(3, 1, 10, 100, 0.0))
    first.observe_finish(finished("length", 5, 7))
    first.observe_first_output(finished("length", 5, 7))
    second.observe_finish(finished("length", 2, 3))
    second.observe_finish(finished("stop", 4, 1))
    first.observe_peer(decode(encode(second.snapshot(1))))  # as they travel
    second.observe_peer(decode(encode(first.snapshot(0))))
    for metrics in (first, second):
        text = metrics.render().decode()
        assert sample(text, 'aerie_requests_total{finish_type="length"}') == 2
        assert sample(text, 'aerie_requests_total{finish_type="stop"}') == 1
        assert sample(text, "aerie_prompt_tokens_total") == 11
        assert sample(text, "aerie_generation_tokens_total") == 11
        assert sample(text, "aerie_e2e_request_latency_seconds_count") == 3
        assert sample(text, 'aerie_e2e_request_latency_seconds_bucket{le="2.5"}') == 3
        assert sample(text, "aerie_e2e_request_latency_seconds_sum") == 4.5
        assert sample(text, "aerie_time_to_first_token_seconds_count") == 1
        assert sample(text, "aerie_num_running_requests") == 3
        assert sample(text, 'aerie_frontend_requests_total{frontend="tokenizer"}') == 1
        assert sample(text, 'aerie_frontend_requests_total{frontend="tokenizer1"}') == 2
    # A newer snapshot replaces the older one: counts so far, not increments.
    second.observe_finish(finished("length", 1, 1))
    first.observe_peer(second.snapshot(1))
    assert sample(first.render().decode(), 'aerie_requests_total{finish_type="length"}') == 3
