"""`GraphTrace`: when the device was busy, from CUPTI, with each CUDA graph launch one record.

Reads CUPTI's activity records (graph launches, kernels outside graphs, copies, memsets)
through ctypes on the libcupti PyTorch loads, and returns their [start, end) intervals in
microseconds. One activity client per process: never together with torch.profiler.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections import Counter
from collections.abc import Callable

MEMCPY, MEMSET, CONCURRENT_KERNEL, GRAPH_TRACE = 1, 2, 10, 51  # CUpti_ActivityKind
KIND_NAMES = {GRAPH_TRACE: "graph", CONCURRENT_KERNEL: "kernel", MEMCPY: "memcpy", MEMSET: "memset"}
# Every record starts with its 32-bit kind; where its start and end (ns) sit, the same in the
# CUPTI record versions of CUDA 11-13. Other kinds are skipped.
START_OFFSET = {GRAPH_TRACE: 8, CONCURRENT_KERNEL: 16, MEMCPY: 16, MEMSET: 16}  # end: +8
BUFFER_BYTES = 8 << 20
FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED

_size_p = ctypes.POINTER(ctypes.c_size_t)
BufferRequested = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), _size_p, _size_p)
BufferCompleted = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
)
LIBRARY_PATTERNS = (
    "nvidia/*/lib/libcupti.so*",
    "lib/libcupti.so*",
    "extras/CUPTI/lib64/libcupti.so*",
)


def read_records(
    next_record: Callable[[ctypes.c_void_p], bool],
    counts: Counter,
    intervals: list[tuple[float, float]],
    since: int = 0,
) -> None:
    """Walk one buffer: `next_record(pointer)` moves `pointer` to the next record and says
    whether there was one. Appends the interval (us) of each known record that starts at or
    after `since` (ns) and counts it by kind; records without timestamps (start and end 0) are
    counted as "untimed"."""
    record = ctypes.c_void_p()
    while next_record(record):
        kind = ctypes.c_uint32.from_address(record.value).value
        offset = START_OFFSET.get(kind)
        if offset is None:
            continue
        start = ctypes.c_uint64.from_address(record.value + offset).value
        end = ctypes.c_uint64.from_address(record.value + offset + 8).value
        if start == 0 and end == 0:
            counts["untimed"] += 1
            continue
        if start < since:
            continue
        counts[KIND_NAMES[kind]] += 1
        intervals.append((start / 1e3, end / 1e3))


def find_libcupti(maps: str = "/proc/self/maps", roots: list[str] | None = None) -> str:
    """The libcupti this process already has loaded (PyTorch's, listed in `maps`), else one
    under `roots` (torch's directory, sys.path and the CUDA toolkit: the CUDA wheels and the
    toolkit's layouts) matching torch's CUDA major version."""
    with open(maps) as lines:
        for line in lines:
            if "libcupti.so" in line:
                return line.split()[-1]
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    if roots is None:
        toolkit = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        roots = [os.path.dirname(torch.__file__), *sys.path, toolkit]
    for root in roots:
        for pattern in LIBRARY_PATTERNS:
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return next((f for f in found if f.endswith(f".so.{major}")), found[-1])
    raise RuntimeError(
        f"CUPTI (libcupti.so) was not found for CUDA {torch.version.cuda}: "
        "install the nvidia cupti wheel of that CUDA version, or set "
        "AERIE_PROFILE_TRACER=kernels to use torch.profiler instead"
    )


TRACED_KINDS = (GRAPH_TRACE, CONCURRENT_KERNEL, MEMCPY, MEMSET)
NOT_YET = 2**64 - 1  # `since` before window(): no record is kept
_KEPT: list = []  # every instance's callbacks and buffers, which CUPTI may use at any time


class GraphTrace:
    """start(), window(), run the work, stop() -> (intervals in us, record counts by kind) of
    what ran from window() on. `kinds`: the activity kinds to record (all four by default).

    Start it before any CUDA graph is captured: CUPTI (CUDA 13.0, on the lent H100) crashed
    the process replaying, with graph records enabled, a graph captured while they were off.
    Until window() is called, completed buffers are dropped unread; CUPTI still times every
    kernel launched outside a graph from start() on (the start-up warm-up, prefills), at a
    cost this module does not measure.

    CUPTI keeps the callbacks and buffers it was given and has no call to unregister them, so
    every instance's callbacks and buffers stay referenced for the life of the process
    (`_KEPT`)."""

    def __init__(self, kinds: tuple[int, ...] = TRACED_KINDS) -> None:
        self.wanted = kinds
        self.lib = ctypes.CDLL(find_libcupti())
        self.lib.cuptiActivityGetNextRecord.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        self.buffers: dict[int, ctypes.Array] = {}  # address -> buffer, alive until completed
        self.counts: Counter = Counter()
        self.intervals: list[tuple[float, float]] = []
        self._requested = BufferRequested(self._request)
        self._completed = BufferCompleted(self._complete)
        _KEPT.append((self._requested, self._completed, self.buffers))
        self.kinds: list[int] = []  # enabled
        self.refused: list[str] = []
        self.since = NOT_YET  # ns: records that start earlier are dropped

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuptiGetResultString(result, ctypes.byref(message))
            name = message.value.decode() if message.value else "unknown error"
            raise RuntimeError(f"CUPTI {what} failed: {name} ({result})")

    def _request(self, buffer, size, max_records) -> None:
        block = (ctypes.c_uint64 * (BUFFER_BYTES // 8))()  # 8-byte aligned, as CUPTI requires
        self.buffers[ctypes.addressof(block)] = block
        buffer[0], size[0], max_records[0] = ctypes.addressof(block), BUFFER_BYTES, 0

    def _complete(self, context, stream, buffer, size, valid) -> None:
        """On CUPTI's thread (or in a flush): read the buffer, unless no window is open yet."""

        def next_record(record: ctypes.c_void_p) -> bool:
            return self.lib.cuptiActivityGetNextRecord(buffer, valid, ctypes.byref(record)) == 0

        try:
            if self.since != NOT_YET:
                read_records(next_record, self.counts, self.intervals, self.since)
        finally:
            self.buffers.pop(buffer, None)

    def start(self) -> None:
        """Graph records are required; a kind CUPTI refuses beside them is left out and named
        in `refused` (the trace then misses that activity, so it reads more idle, not less)."""
        self._check(
            self.lib.cuptiActivityRegisterCallbacks(self._requested, self._completed),
            "registering activity buffers",
        )
        self.refused = []
        try:
            for kind in self.wanted:
                result = self.lib.cuptiActivityEnable(kind)
                if result != 0 and kind != GRAPH_TRACE:
                    self.refused.append(KIND_NAMES.get(kind, str(kind)))
                    continue
                self._check(result, f"enabling {KIND_NAMES.get(kind, kind)}")
                self.kinds.append(kind)
        except BaseException:
            self._disable()
            raise

    def window(self) -> None:
        """Keep the records of what starts from now on (and only those)."""
        now = ctypes.c_uint64()
        self._check(self.lib.cuptiGetTimestamp(ctypes.byref(now)), "reading the timestamp")
        self.since = now.value
        self.counts.clear()
        self.intervals.clear()

    def _disable(self) -> None:
        for kind in self.kinds:
            self.lib.cuptiActivityDisable(kind)
        self.kinds.clear()

    def stop(self) -> tuple[list[tuple[float, float]], dict[str, int]]:
        """Flush every buffer (call after synchronizing the device), then stop tracing. A record
        made between the two reaches a buffer CUPTI completes later: `_KEPT` keeps its callback
        alive, and it lands in no returned list."""
        try:
            self._check(self.lib.cuptiActivityFlushAll(FLUSH_FORCED), "flushing records")
        finally:
            self._disable()
        dropped = ctypes.c_size_t()
        if self.lib.cuptiActivityGetNumDroppedRecords(None, 0, ctypes.byref(dropped)) == 0:
            self.counts["dropped"] += dropped.value  # records CUPTI had no buffer for
        intervals, counts = self.intervals, dict(self.counts)
        self.intervals, self.counts = [], Counter()
        return intervals, counts
