"""A batch as the plan gives it, on the host, and the pinned staging that moves it to the device.

`Staging.upload` packs any number of int64 arrays into one pinned buffer and copies it in ONE
non-blocking copy; it rotates over RING buffers and waits for the copy that last read one
before refilling it, so the host may run ahead of the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode, make_batch


@dataclass(frozen=True)
class HostBatch:
    """A forward's integer inputs on the host (see `ForwardBatch` for their meaning)."""

    mode: ForwardMode
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    out_cache_loc: np.ndarray  # [num_tokens] int64
    rows: np.ndarray  # [bs] int64
    seq_lens: np.ndarray  # [bs] int64, keys attended
    extend_seq_lens: np.ndarray  # [bs] int64

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @classmethod
    def from_requests(
        cls,
        mode: ForwardMode,
        input_ids: Sequence[Sequence[int]],
        committed_lens: Sequence[int],
        out_slots: Sequence[Sequence[int]],
        rows: Sequence[int],
        positions: Sequence[Sequence[int]] | None = None,
    ) -> HostBatch:
        """Per-request lists: request i runs input_ids[i] after committed_lens[i] keys, writing
        KV at out_slots[i]; positions default to committed_lens[i] + arange(len(input_ids[i]))."""
        extend = np.array([len(ids) for ids in input_ids], dtype=np.int64)
        if [len(s) for s in out_slots] != extend.tolist():
            raise ValueError("every request needs as many out slots as input ids")
        prefix = np.asarray(committed_lens, dtype=np.int64)
        if positions is None:
            flat_positions = np.repeat(prefix - np.cumsum(extend) + extend, extend)
            flat_positions += np.arange(int(extend.sum()), dtype=np.int64)
        else:
            flat_positions = _flat(positions)
        return cls(
            mode,
            _flat(input_ids),
            flat_positions,
            _flat(out_slots),
            np.asarray(rows, dtype=np.int64),
            prefix + extend,
            extend,
        )

    def to_device(
        self,
        device: torch.device,
        staging: Staging | None = None,
        custom_mask: torch.Tensor | None = None,
        spec_info: object | None = None,
    ) -> ForwardBatch:
        """The ForwardBatch of these inputs: one copy through staging (a fresh one if None)."""
        staging = staging or Staging(device)
        ids, positions, loc, rows, seq_lens, extend = staging.upload(
            [
                self.input_ids,
                self.positions,
                self.out_cache_loc,
                self.rows,
                self.seq_lens,
                self.extend_seq_lens,
            ]
        )
        return make_batch(
            self.mode,
            ids,
            positions,
            loc,
            rows,
            self.seq_lens.tolist(),
            self.extend_seq_lens.tolist(),
            custom_mask,
            spec_info,
            seq_lens,
            extend,
        )


def _flat(lists: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter((v for row in lists for v in row), dtype=np.int64)


class Staging:
    """Pinned host buffers (RING, in turn) and device buffers for uploads of int64 arrays.

    `upload` starts every array at a 16-byte boundary: Triton compiles a kernel once per
    specialization, and a pointer's 16-byte alignment is part of it, so views at odd int64
    offsets (which depend on the batch's sizes) would make eager steps such as prefill
    compile another variant of a kernel partway through serving."""

    RING = 4
    ALIGN = 2  # int64 entries: 16 bytes

    def __init__(self, device: torch.device | str, capacity: int = 4096) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._device: list[torch.Tensor] = []
        self._next = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._host = [
            torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
            for _ in range(self.RING)
        ]
        self._device = [
            torch.empty(capacity, dtype=torch.int64, device=self.device) for _ in range(self.RING)
        ]
        # One event per buffer, recorded again each time (a new one per copy costs the host
        # an event creation per step); waiting on one never recorded returns at once.
        self._events = [torch.cuda.Event() if self.pinned else None for _ in range(self.RING)]

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 views of arrays, in order, each 16-byte aligned, after one
        host-to-device copy."""
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-len(a) // self.ALIGN) * self.ALIGN
        device = self._copy(arrays, None, starts, total)
        return [device[start : start + len(a)] for start, a in zip(starts, arrays, strict=True)]

    def upload_into(self, dst: torch.Tensor, arrays: Sequence[np.ndarray]) -> None:
        """Copy the concatenation of arrays into the start of dst (int64, on the device) in
        one host-to-device copy (e.g. a CUDA graph's static inputs)."""
        self._copy(arrays, dst, None, sum(len(a) for a in arrays))

    def _copy(
        self,
        arrays: Sequence[np.ndarray],
        dst: torch.Tensor | None,
        starts: list[int] | None,
        total: int,
    ) -> torch.Tensor:
        """starts: where each array goes (None: back to back) in the first total entries."""
        if total > self._host[0].numel():
            for event in self._events:
                if event is not None:
                    event.synchronize()
            self._allocate(max(total, 2 * self._host[0].numel()))
        slot = self._next
        self._next = (slot + 1) % self.RING
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy that last read this buffer is done
        host = self._host[slot]
        device = self._device[slot] if dst is None else dst
        if starts is not None:
            buffer = host.numpy()
            for start, a in zip(starts, arrays, strict=True):
                buffer[start : start + len(a)] = a
        elif arrays:
            np.concatenate(arrays, out=host.numpy()[:total], casting="unsafe")
        device[:total].copy_(host[:total], non_blocking=self.pinned)
        if self.pinned:
            self._events[slot].record()
        return device


class HostCopy:
    """Results back to the host in one pass: each tensor is copied (non-blocking) into pinned
    memory of its own and one event marks the end; `start` returns a `PendingCopy` whose
    `wait` is the host's single synchronisation. Buffers rotate over RING sets, so a copy
    may be started while earlier ones (up to RING - 1) are still pending."""

    RING = 4

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self._next = 0
        # One event per set, recorded again by each copy into it (see `Staging`).
        on_cuda = self.device.type == "cuda"
        self._events = [torch.cuda.Event() if on_cuda else None for _ in range(self.RING)]

    def start(self, *tensors: torch.Tensor) -> PendingCopy:
        """Begin copying tensors (flattened) to the host, after the work queued so far."""
        if self.device.type != "cuda":
            return PendingCopy([t.detach().reshape(-1).clone() for t in tensors], None)
        ring, self._next = self._next, (self._next + 1) % self.RING
        staged = []
        for i, t in enumerate(tensors):
            key = (ring, t.dtype, i)
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < t.numel():
                buffer = torch.empty(max(t.numel(), 256), dtype=t.dtype, pin_memory=True)
                self._buffers[key] = buffer
            view = buffer[: t.numel()]
            view.copy_(t.reshape(-1), non_blocking=True)
            staged.append(view)
        done = self._events[ring]
        done.record()
        return PendingCopy(staged, done)

    def fetch(self, *tensors: torch.Tensor) -> list[np.ndarray]:
        """numpy copies of tensors (flattened), after a single synchronisation."""
        return self.start(*tensors).wait()


class PendingCopy:
    """Host copies on their way; `wait` blocks until they landed and returns numpy copies."""

    def __init__(self, staged: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._staged, self._done = staged, done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> list[np.ndarray]:
        if self._done is not None:
            self._done.synchronize()
        return [view.numpy().copy() for view in self._staged]


def int64_entries(
    values: np.ndarray, itemsize: int = 8, entries: int | None = None, pad: int = 0
) -> np.ndarray:
    """values as int64 entries for `Staging`'s int64 buffers, to be viewed on the device as
    itemsize-byte ints: int32 values (itemsize 4) go two to an entry, so they need no
    conversion there. Padded with pad to `entries` entries when given (else to a whole
    entry)."""
    dtype = np.int64 if itemsize == 8 else np.int32
    per_entry = 8 // itemsize
    size = len(values) if entries is None else entries * per_entry
    size += -size % per_entry
    region = np.full(size, pad, dtype=dtype)
    region[: len(values)] = values
    return region.view(np.int64)


def segment_offsets(lens: np.ndarray) -> np.ndarray:
    """For segments of the given lengths laid end to end: each element's index inside its own
    segment, [sum(lens)]."""
    total = int(lens.sum())
    starts = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lens)
