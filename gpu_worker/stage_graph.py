"""`StageGraph`: a fixed-shape function of per-request device tensors, replayed as CUDA graphs.

The speculative stages (draft loop and tree verify, draft extend, the MTP stack) are functions
of a few per-request inputs (request rows, committed lengths, tokens, ...) that run with the
same shapes for every batch of a given size. A `StageGraph` owns static input buffers for the
largest batch, one per named input, each `[max_bs, *per_request_shape]`; a call copies the
batch's inputs into their first `bs` rows, resets the padded rows `bs .. bucket` to the input's
pad value (request row 0, KV slot 0, length 0: the reserved dummies, so a padded row never
touches a live request's KV), replays the graph of the smallest bucket >= bs, and returns views
of static output buffers (valid until the next call). Larger batches run `fn` directly.

The function `fn(bs, inputs, prefix_cpu)` receives the bucket's input views and the host copy of
the committed lengths (padded with 0): kernels that can be captured read only device tensors;
`prefix_cpu` exists for the eager reference backend (torch_native), whose metadata is built on the
host. Under capture it holds the pad value. `fn` returns a dict of tensors whose first
dimension is a multiple of bs (rows per request); they are copied into static outputs sized
for max_bs.

Stages can be chained without copies: `output_buffers` makes named outputs of one stage be
written (inside its graph) straight into buffers it is given, such as the static inputs of the
next stage, and a call skips the copy of any input that already is its static buffer's view.
The producing stage writes every row of the bucket, its padded rows included (they hold what
the stage computed for the dummy row: valid values of the consumer's pad kind, such as row 0
or length 0).

Capture follows `CudaGraphRunner`: buckets largest first, one memory pool, eager warm-up runs
before each capture. Without capture (CPU, or a backend that cannot be captured) the same
copies, padding and output buffers run eagerly, so CI covers all but the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.cuda_graph import batch_size_buckets, capture_buckets

StageFn = Callable[[int, dict[str, torch.Tensor], list[int]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class StageInput:
    """One per-request input: its shape for one request, dtype and the value of padded rows."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    pad: float = 0


PER_REQUEST = StageInput()  # one int64 per request (rows, lengths, tokens); pads to 0


class DirectStage:
    """A stage run as plain calls on the real batch (no padding, no graphs)."""

    def __init__(self, fn: StageFn) -> None:
        self.fn = fn

    def __call__(self, inputs: dict[str, torch.Tensor], prefix_cpu: list[int]):
        return self.fn(len(prefix_cpu), inputs, prefix_cpu)


class StageGraph:
    def __init__(
        self,
        name: str,
        fn: StageFn,
        inputs: dict[str, StageInput],
        max_bs: int,
        device: torch.device,
        capture: bool,
        pool=None,
        output_buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """pool: a CUDA graph memory pool shared with other stages (default: a new one).
        output_buffers: outputs written into the given tensors (e.g. another stage's `inputs`;
        viewed as [max_bs * rows per request, ...]) instead of buffers of their own."""
        self.name, self.fn = name, fn
        self.output_buffers = output_buffers or {}
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.device = device
        self.captures = capture
        self.inputs = {
            key: torch.full(
                (self.max_bs, *spec.shape), spec.pad, dtype=spec.dtype, device=device
            )  # fmt: skip
            for key, spec in inputs.items()
        }
        self.pads = {key: spec.pad for key, spec in inputs.items()}
        self.outputs: dict[str, torch.Tensor] | None = None
        self.rows_per_req: dict[str, int] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.filled = 0  # rows holding a real request since the last reset
        if capture:
            self.capture_all(pool)

    def bucket_for(self, bs: int) -> int:
        return next(b for b in self.buckets if b >= bs)

    def __call__(
        self, inputs: dict[str, torch.Tensor], prefix_cpu: list[int]
    ) -> dict[str, torch.Tensor]:
        """Run the stage for len(prefix_cpu) requests on `inputs` (each [bs, ...]); a batch larger
        than max_bs runs directly (eager, unpadded)."""
        bs = len(prefix_cpu)
        if bs > self.max_bs:
            return self.fn(bs, inputs, prefix_cpu)
        bucket = self.bucket_for(bs)
        for key, value in inputs.items():
            static = self.inputs[key]
            if value.data_ptr() == static.data_ptr():
                # Written in place by the stage bound to this buffer, which has just run for
                # the same batch (its bucket's rows, padded ones included).
                continue
            static[:bs].copy_(value.reshape(bs, *static.shape[1:]))
            if self.filled > bs:  # rows of an earlier, larger batch: back to the dummies
                static[bs : self.filled].fill_(self.pads[key])
        self.filled = bs
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._run(bucket, [*prefix_cpu, *[0] * (bucket - bs)])
        assert self.outputs is not None
        return {key: out[: bs * self.rows_per_req[key]] for key, out in self.outputs.items()}

    def _run(self, bucket: int, prefix_cpu: list[int]) -> None:
        """The stage on the bucket's static inputs, its results copied to the static outputs."""
        views = {key: buffer[:bucket] for key, buffer in self.inputs.items()}
        result = self.fn(bucket, views, prefix_cpu)
        if self.outputs is None:
            self.outputs = {}
            for key, value in result.items():
                if value.shape[0] % bucket:
                    raise ValueError(f"{self.name}: output {key} has {value.shape[0]} rows, "
                                     f"not a multiple of the batch size {bucket}")  # fmt: skip
                self.rows_per_req[key] = value.shape[0] // bucket
                rows = self.max_bs * self.rows_per_req[key]
                if key in self.output_buffers:
                    self.outputs[key] = self.output_buffers[key].view(rows, *value.shape[1:])
                else:
                    self.outputs[key] = torch.empty((rows, *value.shape[1:]), dtype=value.dtype,
                                                    device=value.device)  # fmt: skip
        for key, value in result.items():
            self.outputs[key][: value.shape[0]].copy_(value)

    def capture_all(self, pool=None) -> None:
        self.captures = True
        self.graphs = capture_buckets(
            self.buckets, lambda bs: self._run(bs, [0] * bs), self.device,
            f"{self.name}, batch sizes", pool,
        )  # fmt: skip
