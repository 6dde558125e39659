"""AERIE_HOST_PROFILE: the window of plans profiled, the files written once, the summary per
plan."""

from __future__ import annotations

import pstats

import pytest

from aerie.host_profile import HostProfile


def work(n: int) -> int:
    return sum(range(n))


def test_profiles_its_window_of_plans_and_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_HOST_PROFILE", f"3,2,{tmp_path}/profile")
    profile = HostProfile.from_env("gpu_worker")
    for plan_id in (1, 2):  # before the window: not profiled
        profile.at(plan_id)
        work(10)
    assert profile.profiler is None
    for plan_id in (3, 4):
        profile.at(plan_id)
        for _ in range(3):
            work(10)
    assert not (tmp_path / "profile" / "gpu_worker.txt").exists()
    profile.at(5)  # past the window: written now
    stats = pstats.Stats(str(tmp_path / "profile" / "gpu_worker.pstats"))
    calls = {name: counts[1] for (_, _, name), counts in stats.stats.items()}
    assert calls["work"] == 6
    text = (tmp_path / "profile" / "gpu_worker.txt").read_text()
    assert text.startswith("2 plans,")
    # 6 calls over 2 plans: 3 a plan, in both orderings.
    assert [line.split()[2] for line in text.splitlines() if line.endswith("(work)")] == [
        "3.00",
        "3.00",
    ]
    profile.at(6)
    work(10)
    profile.write()  # once only: later plans change nothing
    stats = pstats.Stats(str(tmp_path / "profile" / "gpu_worker.pstats"))
    assert {name: c[1] for (_, _, name), c in stats.stats.items()}["work"] == 6


def test_from_env_is_off_without_the_variable_and_rejects_bad_values(monkeypatch):
    monkeypatch.delenv("AERIE_HOST_PROFILE", raising=False)
    assert HostProfile.from_env("scheduler") is None
    for bad in ("10,5", "a,5,/tmp/x", "0,5,/tmp/x", "1,5,"):
        monkeypatch.setenv("AERIE_HOST_PROFILE", bad)
        with pytest.raises(ValueError, match="AERIE_HOST_PROFILE"):
            HostProfile.from_env("scheduler")


def test_a_window_never_reached_writes_nothing(tmp_path):
    profile = HostProfile("scheduler", 100, 5, str(tmp_path))
    profile.at(3)
    profile.write()  # at shutdown
    assert list(tmp_path.iterdir()) == []


def test_a_window_cut_short_counts_the_plans_it_saw(tmp_path):
    profile = HostProfile("gpu_worker", 1, 10, str(tmp_path))
    for plan_id in (1, 2):
        profile.at(plan_id)
        work(10)
    profile.write()  # shutdown before plan 11
    assert (tmp_path / "gpu_worker.txt").read_text().startswith("2 plans,")
