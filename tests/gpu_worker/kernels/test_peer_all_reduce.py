"""The peer all-reduce kernels in Triton's interpreter, every rank in this one process.

The interpreter runs one kernel at a time, so a rank cannot wait for a rank that runs after
it: before rank r runs, what the later ranks would have written to r by its barriers is staged
(their messages, or two-shot part r of them and their summed parts, and their signals). What
the earlier ranks did is left to them, and checked: their signals must already be in r's pad.
On the GPU, tests/gpu_worker/test_peer_reduce.py runs the real thing against NCCL."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_worker.kernels import peer_all_reduce as kernels
from tests.devices import skip_unless_triton_runs_on

PROGRAMS = 4
CAPACITY = 4096  # elements per buffer half


class Ranks:
    """`world` ranks' pads, halves (a slot per rank) and counts in host memory, addressed
    like peers'."""

    def __init__(self, world: int):
        self.world = world
        self.pads = [
            torch.zeros(PROGRAMS, kernels.MAX_RANKS, dtype=torch.int64) for _ in range(world)
        ]
        self.halves = [[torch.zeros(world, CAPACITY) for _ in range(world)] for _ in range(2)]
        self.counts = [torch.zeros(PROGRAMS, 2, dtype=torch.int64) for _ in range(world)]
        addresses = [[b.data_ptr() for b in half] for half in self.halves]
        self.buffers = torch.tensor(addresses, dtype=torch.int64)
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64)

    def reduce(self, messages: list[torch.Tensor], two_shot: bool, call: int) -> list:
        """Every rank's result, ranks run in order 0..world-1."""
        n, world = messages[0].numel(), self.world
        total = sum(messages)
        half = self.halves[call % 2]
        part = kernels._round_up(-(-n // world), kernels.ALIGN.value)
        parts = [slice(q * part, min((q + 1) * part, n)) for q in range(world)]
        barriers = 2 if two_shot else 1
        results = []
        for r in range(world):
            signalled = self.counts[r][:, 1] + barriers
            for p in range(r):  # already ran: their signals must be here
                assert torch.equal(self.pads[r][:, p], signalled), (r, p)
            for p in range(r + 1, world):  # what p will have written to r by r's barriers
                if two_shot:
                    half[r][p, parts[r]] = messages[p][parts[r]]
                    half[r][p, parts[p]] = total[parts[p]]
                else:
                    half[r][p, :n] = messages[p]
                self.pads[r][:, p] = signalled
            x = messages[r].clone()
            out = kernels.all_reduce(
                x, self.buffers, self.pad_ptrs, self.counts[r], r, CAPACITY * 4, not two_shot, 64
            )
            assert out.data_ptr() == x.data_ptr()  # in place
            results.append(out)
        return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_sum_in_rank_order(world: int) -> None:
    skip_unless_triton_runs_on("cpu")
    torch.manual_seed(world)
    ranks = Ranks(world)
    # sizes not divisible by the parts or the programs, one that leaves programs empty, and
    # the kinds interleaved (they share the counts and alternate buffer halves)
    for call, (n, two_shot) in enumerate([(1008, False), (48, True), (4096, True), (16, False)]):
        messages = [torch.randn(n) for _ in range(world)]
        expected = messages[0].clone()
        for m in messages[1:]:
            expected += m  # rank order, in float32, like the kernels
        for rank, out in enumerate(ranks.reduce(messages, two_shot, call)):
            assert torch.equal(out, expected), (call, rank)
        for counts in ranks.counts:
            assert counts[:, 0].tolist() == [call + 1] * PROGRAMS


def test_a_rank_waits_for_this_calls_signal() -> None:
    """Rank 0 holds its result until rank 1 signals this call (not an older one), then
    reads rank 1's message."""
    skip_unless_triton_runs_on("cpu")
    ranks = Ranks(2)
    ranks.reduce([torch.ones(64), torch.ones(64)], False, 0)  # rank 1 signalled call 0
    x = torch.ones(64)
    worker = threading.Thread(
        target=kernels.all_reduce,
        args=(x, ranks.buffers, ranks.pad_ptrs, ranks.counts[0], 0, CAPACITY * 4, True, 64),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=2.0)
    assert worker.is_alive(), "rank 0 went on with rank 1's signal from the call before"
    ranks.halves[1][0][1, :64] = 2.0  # rank 1's push to rank 0 in call 1, then its signal
    ranks.pads[0][:, 1] = 2
    worker.join(timeout=60.0)
    assert not worker.is_alive()
    assert torch.equal(x, torch.full((64,), 3.0))
