"""step_timeline: a step's GPU span, busy time and gaps from device intervals."""

from benchmarks.step_timeline import Interval, between_markers, mean_timeline, step_timeline


def test_gaps_split_into_kernel_launches_and_host_waits():
    step = [
        Interval(0, 10, "a"),
        Interval(11, 20, "b"),  # 1 us: one kernel after another
        Interval(15, 25, "c"),  # overlaps b: no gap
        Interval(50, 60, "d"),  # 25 us: the device waited for the host
        Interval(62, 70, "e"),  # 2 us
        Interval(80, 81, "f"),  # 10 us
    ]
    t = step_timeline(step, short_us=4.0)
    assert t["span_us"] == 81
    assert t["busy_us"] == 10 + 14 + 10 + 8 + 1
    assert (t["short_gaps"], t["short_gap_us"]) == (2, 3)
    assert (t["long_gaps"], t["long_gap_us"]) == (2, 35)
    assert [g["us"] for g in t["longest_gaps"]] == [25, 10]
    # the gap after the overlapping pair is charged to the one that ended last
    assert t["longest_gaps"][0] == {"us": 25, "after": "c", "before": "d"}
    assert t["span_us"] == t["busy_us"] + t["short_gap_us"] + t["long_gap_us"]


def test_steps_are_the_intervals_between_pairs_of_markers():
    names = ["m", "a", "b", "m", "restore", "m", "c", "m", "restore"]
    intervals = [Interval(10 * k, 10 * k + 5, n) for k, n in enumerate(names)]
    steps = between_markers(list(reversed(intervals)), "m")
    assert [[i.name for i in s] for s in steps] == [["a", "b"], ["c"]]
    t = step_timeline(steps[0], start=intervals[0].end)
    assert t["lead_us"] == 5  # the first kernel began 5 us after the marker ended


def test_mean_over_steps():
    a = step_timeline([Interval(0, 10, "a"), Interval(20, 30, "b")])
    b = step_timeline([Interval(0, 10, "a"), Interval(11, 12, "b")])
    mean = mean_timeline([a, b])
    assert mean["span_us"] == (30 + 12) / 2
    assert mean["long_gaps"] == 0.5
    assert mean["longest_gaps"] == a["longest_gaps"]
