"""`PeerAllReduce`: the tensor-parallel all-reduce of small messages on one machine, through
buffers every rank opens in the others' GPU memory (CUDA IPC) and the Triton kernels of
`gpu_worker.kernels.peer_all_reduce`; larger messages, and groups across machines, stay on
NCCL (`TensorParallel.all_reduce` chooses).

Why: a decode step of an 8B model at batch 1 makes 64 all-reduces of 8 KiB each, and NCCL's
protocols, built for bandwidth, take about twice as long per call as one push and one barrier
(docs/performance.md, "Tensor and data parallelism").
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.kernels import peer_all_reduce as kernels

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PAD_BYTES = 64 * 1024  # the signal pad ahead of the buffers (int64 [programs, MAX_RANKS])


@dataclass(frozen=True)
class Limits:
    """Message sizes in bytes: one-shot up to one_shot_max, two-shot up to max_bytes (the
    size of each slot: a rank's block holds 2 x ranks of them), NCCL above; programs: the
    kernels' fixed grid."""

    max_bytes: int = 1 << 20
    one_shot_max: int = 256 << 10
    programs: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.programs * kernels.MAX_RANKS * 8 <= PAD_BYTES:
            raise ValueError(f"programs must be in 1..{PAD_BYTES // (8 * kernels.MAX_RANKS)}")


def default_limits(world: int) -> Limits:
    """Where each path is fastest, by `benchmarks/bench_all_reduce.py` (figures in
    docs/performance.md): on two GPUs one-shot up to 2 MiB and NCCL above (two-shot, writing as
    much in two barriers, never wins there). More ranks: not measured yet."""
    if world == 2:
        return Limits(max_bytes=2 << 20, one_shot_max=2 << 20)
    return Limits()


class PeerAllReduce:
    """One rank's side. Build every rank's with `open_peers` (collective: all ranks call it
    with the same limits); then every rank must make the same calls in the same order, like
    any collective."""

    def __init__(self, rank: int, memory: torch.Tensor, peers: list, limits: Limits):
        """memory: this rank's block (uint8); peers: the others' blocks opened here (kept
        alive while this lives), in rank order, None at `rank`."""
        world = len(peers)
        self.rank, self.world, self.limits = rank, world, limits
        self._memory, self._peers = memory, peers
        bases = [memory.data_ptr() if s is None else s.data_ptr() for s in peers]
        device = memory.device
        self.pads = torch.tensor(bases, dtype=torch.int64, device=device)
        half_bytes = world * limits.max_bytes  # a slot per rank
        halves = [[b + PAD_BYTES + h * half_bytes for b in bases] for h in (0, 1)]
        self.buffers = torch.tensor(halves, dtype=torch.int64, device=device)
        self.counts = torch.zeros(limits.programs, 2, dtype=torch.int64, device=device)

    def close(self) -> None:
        """Let go of the peers' blocks (after this rank's last call has run). Ranks that close
        before they exit leave no peer holding memory its owner is freeing."""
        torch.cuda.synchronize(self._memory.device)
        self._peers = []

    def fits(self, x: torch.Tensor) -> bool:
        size = x.numel() * x.element_size()
        return (
            size <= self.limits.max_bytes
            and x.dtype in DTYPES
            and x.numel() % kernels.ALIGN.value == 0
            and x.is_contiguous()
        )

    def all_reduce(self, x: torch.Tensor, one_shot: bool | None = None) -> torch.Tensor:
        """Sum x over the ranks, in place (x must `fit`); one-shot or two-shot by its size
        unless `one_shot` says."""
        if one_shot is None:
            one_shot = x.numel() * x.element_size() <= self.limits.one_shot_max
        return kernels.all_reduce(
            x, self.buffers, self.pads, self.counts, self.rank, self.limits.max_bytes, one_shot
        )


def block_bytes(limits: Limits, world: int) -> int:
    return PAD_BYTES + 2 * world * limits.max_bytes


def open_peers(
    rank: int,
    world: int,
    device: torch.device,
    gather: Callable[[object], list[object]],
    limits: Limits | None = None,
) -> PeerAllReduce | None:
    """Allocate this rank's block, share it, open the others'. Collective over `gather`
    (every rank's value in rank order). None on every rank, with a warning, unless every
    rank is on this machine and could open every peer's block: then NCCL does it all."""
    limits = limits or default_limits(world)
    index = torch.cuda.current_device() if device.index is None else device.index
    reason = _unusable(world, index, gather)
    memory, peers = None, [None] * world
    if reason is None:
        try:
            memory = torch.zeros(block_bytes(limits, world), dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)  # zeroed pads before any peer can signal
            handle = memory.untyped_storage()._share_cuda_()
        except RuntimeError as e:
            reason, handle = f"sharing GPU memory failed: {e}", None
    else:
        handle = None
    handles = gather(handle)
    if reason is None and any(h is None for h in handles):
        reason = "another rank could not share its memory"
    if reason is None:
        try:
            for peer, peer_handle in enumerate(handles):
                if peer != rank:
                    # opened on this rank's device (the handle names the peer's): mapped
                    # for this device's kernels, which is who reads it
                    _, *rest = peer_handle
                    peers[peer] = torch.UntypedStorage._new_shared_cuda(index, *rest)
        except RuntimeError as e:
            reason = f"opening a peer's memory failed: {e}"
    reasons = gather(reason)
    failed = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
    if failed:
        if rank == 0:
            log.warning("all-reduce through NCCL only (%s)", "; ".join(failed))
        return None
    if rank == 0:
        two_shot = limits.max_bytes > limits.one_shot_max
        log.info(
            "peer all-reduce over %d GPUs: one-shot to %d KiB%s, NCCL above",
            world,
            limits.one_shot_max >> 10,
            f", two-shot to {limits.max_bytes >> 10} KiB" if two_shot else "",
        )
    return PeerAllReduce(rank, memory, peers, limits)


def _unusable(world: int, index: int, gather: Callable[[object], list[object]]) -> str | None:
    """Why this group cannot reduce through peer memory, or None (collective)."""
    places = gather((socket.gethostname(), index))
    if world > kernels.MAX_RANKS:
        return f"more than {kernels.MAX_RANKS} ranks"
    if len({host for host, _ in places}) > 1:
        return "the ranks are on more than one machine"
    unreachable = [
        peer
        for _, peer in places
        if peer != index and not torch.cuda.can_device_access_peer(index, peer)
    ]
    if unreachable:
        return f"GPU {index} cannot reach GPU(s) {unreachable} directly"
    return None
