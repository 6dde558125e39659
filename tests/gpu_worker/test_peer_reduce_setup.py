"""Whether a tensor-parallel group reduces through peer memory is agreed by every rank: one
rank that cannot (a rank on another machine, too many ranks) sends them all to NCCL, and rank
0 says why. Runs anywhere: the other ranks' answers are scripted, no GPU is touched."""

from __future__ import annotations

import logging
import socket

import pytest
import torch

from gpu_worker.peer_reduce import open_peers


def scripted(*others: list[object]):
    """A gather for rank 0 whose other ranks answer `others[i]` to the i-th collective."""
    calls = iter(others)

    def gather(value: object) -> list[object]:
        return [value, *next(calls)]

    return gather


def test_ranks_on_two_machines_reduce_through_nccl(caplog: pytest.LogCaptureFixture) -> None:
    gather = scripted([("other-host", 1)], [None], ["the ranks are on more than one machine"])
    with caplog.at_level(logging.WARNING):
        assert open_peers(0, 2, torch.device("cuda", 0), gather) is None
    assert "NCCL only" in caplog.text and "more than one machine" in caplog.text


def test_too_many_ranks_for_the_signal_pad_reduce_through_nccl(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = socket.gethostname()
    places = [(host, i) for i in range(1, 9)]
    gather = scripted(places, [None] * 8, ["more than 8 ranks"] * 8)
    with caplog.at_level(logging.WARNING):
        assert open_peers(0, 9, torch.device("cuda", 0), gather) is None
    assert "rank 0: more than 8 ranks" in caplog.text
