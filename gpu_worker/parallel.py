"""Tensor parallelism: the rank's place in its group (`TensorParallel`) and its collectives.

Every rank runs the same forward on its shard of the weights and ends with the same logits,
so it samples the same tokens and keeps the same row state: nothing is broadcast after a step
(`docs/gpu.md`, "Tensor and data parallelism"). `TensorParallel()` (size 1) is the identity.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.peer_reduce import PeerAllReduce, open_peers

log = logging.getLogger(__name__)

# How long a serving rank waits for the others in a collective before it fails (instead of
# hanging when a peer died). Start-up (rendezvous, loading, agreeing on the KV size) gets the
# server's start-up timeout instead: ranks may load weights at different speeds.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size); group: the process group of the ranks (None when size is 1);
    cpu_group: a gloo group over the same ranks for host values (sizes agreed at start-up);
    peer: the all-reduce through peer memory for messages it fits (ranks of one machine)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    peer: PeerAllReduce | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of `total` (heads, rows); raises
        ValueError naming `what` when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the TP size ({self.size})")
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: its share, or with fewer KV heads
        than ranks the one KV head its query heads read (replicated)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"the TP size ({self.size}) must be a multiple of the number of KV heads "
                f"({num_kv_heads}) when it exceeds it"
            )
        return self.rank // (self.size // num_kv_heads), 1

    def vocab_block(self, vocab_size: int) -> tuple[int, int]:
        """(start, count) of this rank's token ids: blocks of ceil(V / size), the last one
        padded past V (padded rows hold zeros and their logits are dropped)."""
        count = -(-vocab_size // self.size)
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place (x itself when size is 1). Every rank gets
        the same bits, so every rank samples the same tokens."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits(x):
                return self.peer.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, k] on each rank -> [n, size * k], rank blocks in rank order."""
        if self.size == 1:
            return x
        n, k = x.shape
        gathered = torch.empty((self.size * n, k), dtype=x.dtype, device=x.device)
        _all_gather_single(gathered, x.contiguous(), group=self.group)
        return gathered.view(self.size, n, k).permute(1, 0, 2).reshape(n, self.size * k)

    def gather_objects(self, value: object) -> list[object]:
        """Every rank's value, in rank order (host values over the gloo group)."""
        if self.size == 1:
            return [value]
        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.cpu_group)
        return values

    def start_serving(self) -> None:
        """Shorten the groups' timeout from the start-up one to COLLECTIVE_TIMEOUT."""
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if self.size == 1 or set_timeout is None:  # older torch: the start-up timeout stays
            return
        for group in {self.group, self.cpu_group}:
            set_timeout(COLLECTIVE_TIMEOUT, group)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (each rank's KV pool holds what the smallest
        one fits, so one slot count serves all)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TensorParallel()  # one device: no sharding, every collective the identity


# torch 2.13 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tensor_parallel(
    rank: int,
    size: int,
    init_address: str,
    device: torch.device,
    startup_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
    peer_all_reduce: bool = True,
) -> TensorParallel:
    """Join the group of `size` ranks that meet at init_address (host:port, rank 0 listens):
    NCCL on CUDA (each rank on its own GPU, `device`), gloo on CPU; plus a gloo group for host
    values. Collectives wait up to startup_timeout until `start_serving`. On CUDA, with
    peer_all_reduce, ranks of one machine also open each other's buffers for small
    all-reduces (`gpu_worker.peer_reduce`). Size 1 needs no group."""
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NOTE: with device_id NCCL sets up its communicator now, so its buffers are taken before
    # the KV pool is sized from the free memory.
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_address}",
        rank=rank,
        world_size=size,
        timeout=startup_timeout,
        device_id=device_id,
    )
    ranks = list(range(size))
    cpu_group = dist.new_group(ranks, backend="gloo") if backend == "nccl" else dist.group.WORLD
    log.info("TP rank %d of %d joined (%s) at %s", rank, size, backend, init_address)
    tp = TensorParallel(rank, size, dist.group.WORLD, cpu_group)
    if backend == "nccl" and peer_all_reduce:
        tp = dataclasses.replace(tp, peer=open_peers(rank, size, device, tp.gather_objects))
    return tp
