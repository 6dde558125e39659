"""`run_ranks`: a group of spawned ranks returns each rank's result in rank order, and a rank
that raises or dies is reported with what happened to it, not waited for."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from gpu_worker.tooling.ranks import RankFailure, run_ranks


def summed(rank: int, world: int, address: str, base: int) -> tuple[int, float]:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
    x = torch.tensor([float(base + rank)])
    dist.all_reduce(x)
    return rank, float(x)


def fails_on_rank_one(rank: int, world: int, address: str) -> int:
    if rank == 1:
        raise ValueError("rank one's own error")
    return rank


def rank_one_fails_the_collective(rank: int, world: int, address: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
    if rank == 1:
        raise ValueError("rank one never joins")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 for ever


def dies_on_rank_one(rank: int, world: int, address: str) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_each_ranks_result_comes_back_in_rank_order():
    assert run_ranks(summed, 3, 10) == [(0, 33.0), (1, 33.0), (2, 33.0)]


def test_a_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 1 raised.*ValueError: rank one's own error"):
        run_ranks(fails_on_rank_one, 2)


def test_the_others_get_a_grace_period_after_a_rank_raises_then_are_killed():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="(?s)rank 1 raised.*rank one never joins"):
        run_ranks(rank_one_fails_the_collective, 2, timeout_s=300, exit_timeout_s=2)
    assert time.monotonic() - start < 60  # not the 300 s timeout


def test_a_rank_that_dies_is_reported_without_waiting_for_the_timeout():
    with pytest.raises(RankFailure, match=r"rank 1 exited \(3\) with no result"):
        run_ranks(dies_on_rank_one, 2, timeout_s=120)
