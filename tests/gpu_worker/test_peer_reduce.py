"""The peer all-reduce on a machine of 2 or more GPUs (up to 4 ranks), against NCCL: every size
class (one-shot, its boundary, two-shot, the largest message) and dtype, eagerly and replayed
from a CUDA graph with new inputs. Results must be the rank-order float32 sum rounded once,
bit for bit, on every rank; with two ranks that is NCCL's result exactly, with more NCCL sums
in another order, so it is only close. Skipped with fewer than two GPUs; the interpreter test
(tests/gpu_worker/kernels/test_peer_all_reduce.py) covers the kernels on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu_worker.parallel import init_tensor_parallel
from gpu_worker.peer_reduce import DTYPES
from gpu_worker.tooling.ranks import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rank_order_sum(tp, x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, summed in float32 in rank order and rounded once."""
    gathered = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(gathered, x, group=tp.group)
    total = gathered[0].float()
    for other in gathered[1:]:
        total += other.float()
    return total.to(x.dtype)


def same_on_every_rank(tp, x: torch.Tensor) -> bool:
    gathered = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(gathered, x, group=tp.group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def check(tp, x: torch.Tensor, got: torch.Tensor, what: str) -> None:
    nccl = x.clone()
    dist.all_reduce(nccl, group=tp.group)
    assert torch.equal(got, rank_order_sum(tp, x)), f"{what}: not the rank-order sum"
    assert same_on_every_rank(tp, got), f"{what}: ranks differ"
    if tp.size == 2:
        assert torch.equal(got, nccl), f"{what}: not NCCL's sum"
    tol = TOLERANCE[x.dtype] * tp.size
    torch.testing.assert_close(got, nccl, atol=tol, rtol=tol, msg=what)


def run_rank(rank: int, world: int, address: str) -> None:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, world, address, device)
    peer = tp.peer
    assert peer is not None, "peer all-reduce not set up"
    generator = torch.Generator(device).manual_seed(rank)
    for dtype in DTYPES:
        size = torch.finfo(dtype).bits // 8
        limit = peer.limits
        lengths = [16, 4096, limit.one_shot_max // size, limit.one_shot_max // size + 16]
        lengths.append(limit.max_bytes // size)
        lengths = [n for n in lengths if n * size <= limit.max_bytes]
        for n in lengths:
            x = torch.randn(n, generator=generator, device=device).to(dtype)
            assert peer.fits(x)
            check(tp, x, tp.all_reduce(x.clone()), f"{dtype} x {n}")
            # both kinds at every size, whichever the limits pick (two GPUs: one-shot)
            for one_shot in (True, False):
                got = peer.all_reduce(x.clone(), one_shot)
                check(tp, x, got, f"{dtype} x {n}, one-shot {one_shot}")
    # past the buffers: NCCL, and the peer kernels' counts untouched
    big = torch.randn(peer.limits.max_bytes // 4 + 16, device=device)
    assert not peer.fits(big)
    counts = peer.counts.clone()
    nccl = big.clone()
    dist.all_reduce(nccl, group=tp.group)
    assert torch.equal(tp.all_reduce(big.clone()), nccl), "past the buffers: not NCCL's"
    assert torch.equal(peer.counts, counts)
    # a graph of three reductions (both kinds), replayed with new inputs each time
    static = [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in (4096, 1 << 20, 64)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [peer.all_reduce(s, i != 1) for i, s in enumerate(static)]
    for replay in range(5):
        inputs = [torch.randn(s.shape, generator=generator, device=device) for s in static]
        for s, new in zip(static, inputs, strict=True):
            s.copy_(new)
        graph.replay()
        for out, new in zip(outs, inputs, strict=True):
            check(tp, new.to(torch.bfloat16), out, f"graph replay {replay}, {out.numel()}")
    peer.close()
    dist.barrier(group=tp.cpu_group)  # every rank let go before any frees its own


def test_peer_all_reduce_matches_nccl() -> None:
    # a rank that has not exited 30 s after its checks fails it: it hung on the peers' memory
    run_ranks(run_rank, min(4, torch.cuda.device_count()), exit_timeout_s=30.0)
