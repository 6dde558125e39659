"""`StageGraph`: a fixed-shape function of per-request device tensors, replayed as CUDA graphs.

A stage's inputs and outputs are dataclasses of tensors, one static buffer [max_bs, *shape] a
field. A call copies the batch in, pads rows bs .. bucket with the reserved dummies (row 0,
slot 0, length 0) so they never touch a live request, replays the bucket's graph and returns
views of static outputs, valid until the next call. Without capture the same path runs eagerly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from gpu_worker.graphs.capture import batch_size_buckets, capture_buckets
from gpu_worker.step.host_batch import Staging, int64_entries

In = TypeVar("In")  # a stage's input dataclass
Out = TypeVar("Out")  # its output dataclass (or None)
# A field of a host-fed stage's inputs: a host array for `call_host`, a tensor in the stage.
Array = TypeVar("Array", bound=np.ndarray | torch.Tensor)
# fn(bs, inputs, committed_lens_cpu): the bucket's input views and the host committed lengths
# (pads 0; only the torch_native reference reads them, and under capture they are pads). It
# returns a dataclass of tensors (None for a field it leaves out), each with a multiple of bs
# rows, or None.
StageFn = Callable[[int, In, list[int]], Out]


@dataclass(frozen=True)
class StageInput:
    """One per-request input: its shape for one request, dtype and the value of padded rows."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    pad: float = 0


PER_REQUEST = StageInput()  # one int64 per request (rows, lengths, tokens); pads to 0


def tensor_fields(buffers: Any) -> dict[str, torch.Tensor]:
    """The fields of a stage dataclass that hold a tensor, by name (those that are None left
    out): e.g. another stage's static `inputs`, to share as `input_buffers`."""
    found = ((f.name, getattr(buffers, f.name)) for f in dataclasses.fields(buffers))
    return {name: value for name, value in found if value is not None}


def field_specs(
    name: str, input_type: type, specs: Mapping[str, StageInput]
) -> dict[str, StageInput]:
    """specs in the order of input_type's fields, which they must name exactly."""
    names = [f.name for f in dataclasses.fields(input_type)]
    if set(specs) != set(names):
        raise ValueError(
            f"{name}: inputs {sorted(specs)} are not the fields of {input_type.__name__}, "
            f"{sorted(names)}"
        )
    return {key: specs[key] for key in names}


class DirectStage(Generic[In, Out]):
    """A stage run as plain calls on the real batch (no padding, no graphs)."""

    def __init__(
        self,
        fn: StageFn,
        device: torch.device | None = None,
        host_inputs: dict[str, StageInput] | None = None,
    ) -> None:
        """host_inputs: the inputs `call_host` takes, by field (device: where they go)."""
        self.fn = fn
        self.host_inputs = host_inputs or {}
        self.staging = Staging(device) if host_inputs and device is not None else None

    def __call__(self, inputs: In, committed_lens_cpu: list[int]) -> Out:
        return self.fn(len(committed_lens_cpu), inputs, committed_lens_cpu)

    def capacity(self, bs: int) -> None:
        """No bound on the values `call_host` takes (see `StageGraph.capacity`)."""
        return None

    def call_host(self, bs: int, arrays: In) -> Out:
        """Run on host arrays (flat, as `StageGraph.call_host` takes them), in one copy."""
        assert self.staging is not None, "a DirectStage made without host_inputs"
        return self.fn(bs, upload_flat(self.staging, self.host_inputs, arrays), [0] * bs)


def upload_flat(staging: Staging, specs: dict[str, StageInput], arrays: In) -> In:
    """arrays (a stage's inputs, flat, of the specs' dtypes) on the device in one copy,
    unpadded: int32 ones two to an int64 entry and viewed back; those on the device already
    as they are."""
    host = {key: getattr(arrays, key) for key in specs}
    keys = [key for key, values in host.items() if not isinstance(values, torch.Tensor)]
    views = staging.upload([int64_entries(host[key], specs[key].dtype.itemsize) for key in keys])
    uploaded = {
        key: view.view(torch.int32)[: len(host[key])] if specs[key].dtype == torch.int32 else view
        for key, view in zip(keys, views, strict=True)
    }
    return dataclasses.replace(arrays, **uploaded)


class StageGraph(Generic[In, Out]):
    def __init__(
        self,
        name: str,
        fn: StageFn,
        input_type: type[In],
        inputs: Mapping[str, StageInput],
        max_bs: int,
        device: torch.device,
        capture: bool,
        pool=None,
        output_buffers: Out | None = None,
        host_inputs: bool = False,
        input_buffers: Mapping[str, torch.Tensor] | None = None,
        capture_max_bs: int | None = None,
        buckets: list[int] | None = None,
        output_rows: Mapping[str, Callable[[int], int]] | None = None,
    ) -> None:
        """input_type: the dataclass `fn` takes; inputs: the spec of each of its fields.
        pool: a CUDA graph memory pool shared with other stages (default: a new one).
        output_buffers: an instance of the output type whose fields that are not None are
        tensors to write those outputs into (e.g. another stage's `inputs`; viewed as
        [max_bs * rows per request, ...]) instead of buffers of their own. The stage writes
        every row of the bucket there, padded ones included, so the consumer's pads stay valid
        (row 0, length 0) and its call skips the copy of an input already in its buffer.
        host_inputs: the inputs come from the host through `call_host` (int64 or int32, each
        of shape () or (width,)), packed in one buffer.
        input_buffers: inputs, by field, that are given tensors ([max_bs, *shape], e.g.
        another stage's `inputs`, so that one producer's outputs feed several stages) instead
        of buffers of their own. Such an input must arrive in its buffer (a call raises
        otherwise): the padding of a shared buffer is its owner's to keep.
        capture_max_bs: the largest bucket captured (default: all). Larger buckets up to max_bs
        run the same padded path eagerly on the static buffers: for stages whose graphs would
        keep too much memory at large batches, where the host's launches cost little next to
        the GPU's work anyway.
        buckets: the sizes captured (default: `batch_size_buckets(max_bs)`).
        output_rows: the rows an output field has at a bucket, for outputs not a fixed number
        of rows per request (a call returns those rows whole)."""
        self.name, self.fn = name, fn
        self.output_buffers = output_buffers
        self.output_rows = output_rows or {}
        self.buckets = buckets or batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.capture_max_bs = self.max_bs if capture_max_bs is None else capture_max_bs
        self.device = device
        self.captures = capture
        self.input_type = input_type
        self.specs = field_specs(name, input_type, inputs)
        self.host_inputs = host_inputs
        given = input_buffers or {}
        if set(given) - set(self.specs):
            raise ValueError(f"{name}: no inputs {sorted(set(given) - set(self.specs))} to bind")
        self.bound = set(given)  # inputs whose buffers other stages share
        if host_inputs:
            assert not given, "a stage fed from the host owns its packed inputs"
            self._pack_inputs()
        else:
            self.buffers: dict[str, torch.Tensor] = {}
            for key, spec in self.specs.items():
                shape = (self.max_bs, *spec.shape)
                if key in given:
                    if tuple(given[key].shape) != shape or given[key].dtype != spec.dtype:
                        raise ValueError(
                            f"{name}: input {key} is bound to a {given[key].dtype} "
                            f"tensor of {tuple(given[key].shape)}, not "
                            f"{spec.dtype} {shape}"
                        )
                    self.buffers[key] = given[key]
                else:
                    self.buffers[key] = torch.full(shape, spec.pad, dtype=spec.dtype, device=device)
        self.inputs: In = input_type(**self.buffers)  # the static inputs, at max_bs
        self.pads = {key: spec.pad for key, spec in self.specs.items()}
        self.outputs: dict[str, torch.Tensor] | None = None  # by field, once a run made them
        self.output_type: Any = None
        self.absent: dict[str, None] = {}  # the output fields `fn` leaves None
        self.rows_per_req: dict[str, int] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.filled = 0  # rows holding a real request since the last reset
        if capture:
            self.capture_all(pool)

    def bucket_for(self, bs: int) -> int:
        return next(b for b in self.buckets if b >= bs)

    def _pack_inputs(self) -> None:
        """One int64 device buffer holding every input at max_bs (`buffers`: flat views of
        it), the host-side pads of each, and the staging that fills it."""
        self.widths = {key: math.prod(spec.shape) for key, spec in self.specs.items()}
        self._pads = {
            key: int64_entries(
                np.zeros(0), spec.dtype.itemsize, self.max_bs * self.widths[key], int(spec.pad)
            )
            for key, spec in self.specs.items()
        }
        self.packed = torch.from_numpy(np.concatenate(list(self._pads.values()))).to(self.device)
        self.buffers, start = {}, 0
        for (key, spec), pad in zip(self.specs.items(), self._pads.values(), strict=True):
            view = self.packed[start : start + len(pad)]
            count = self.max_bs * self.widths[key]
            self.buffers[key] = (
                view.view(torch.int32)[:count] if spec.dtype == torch.int32 else view
            )
            start += len(pad)
        self.staging = Staging(self.device, capacity=self.packed.numel())

    def _host_regions(self, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The pieces of the packed buffer, in order: each input's values, then the rest of its
        pad (int32 inputs packed into int64 entries; int64 ones as they are, copied once)."""
        pieces = []
        for key, spec in self.specs.items():
            values, pad = arrays[key], self._pads[key]
            if spec.dtype == torch.int32:
                pieces.append(int64_entries(values, 4, len(pad), int(spec.pad)))
            else:
                pieces += [values, pad[len(values) :]]
        return pieces

    def capacity(self, bs: int) -> int | None:
        """How many values per input of width 1 a batch of bs can hand `call_host` (times the
        width for wider ones): its bucket's; None when it runs directly, without a bound."""
        return None if bs > self.max_bs else self.bucket_for(bs)

    def call_host(self, bs: int, arrays: In) -> Out:
        """Run the stage for bs requests on host arrays (the input type with, in each field, a
        flat array of its dtype, at most capacity(bs) * width values): one copy of the whole
        packed buffer, pads included, then the replay. An input given as a device tensor
        instead (e.g. tokens fed back from the step before) is copied into its view after that
        copy. A batch larger than max_bs runs directly, unpadded."""
        assert self.host_inputs, f"{self.name}: a stage made without host_inputs"
        if bs > self.max_bs:
            return self.fn(bs, upload_flat(self.staging, self.specs, arrays), [0] * bs)
        bucket = self.bucket_for(bs)
        host = {key: getattr(arrays, key) for key in self.specs}
        for key, values in host.items():
            count = values.numel() if isinstance(values, torch.Tensor) else len(values)
            if count > bucket * self.widths[key]:
                raise ValueError(
                    f"{self.name}: {count} values of {key} for a batch of "
                    f"{bs} (at most {bucket * self.widths[key]})"
                )
        on_device = {k: v for k, v in host.items() if isinstance(v, torch.Tensor)}
        host = {k: np.zeros(0, np.int64) if k in on_device else v for k, v in host.items()}
        self.staging.upload_into(self.packed, self._host_regions(host))
        for key, values in on_device.items():
            self.buffers[key][: values.numel()].copy_(values.reshape(-1))
        return self._replay(bs, bucket, [0] * bs)

    def __call__(self, inputs: In, committed_lens_cpu: list[int]) -> Out:
        """Run the stage for len(committed_lens_cpu) requests on `inputs` (each field [bs,
        ...]); a batch larger than max_bs runs directly (eager, unpadded)."""
        assert not self.host_inputs, f"{self.name}: its inputs come through call_host"
        bs = len(committed_lens_cpu)
        if bs > self.max_bs:
            return self.fn(bs, inputs, committed_lens_cpu)
        bucket = self.bucket_for(bs)
        for key, static in self.buffers.items():
            value = getattr(inputs, key)
            if value.data_ptr() == static.data_ptr():
                # Written in place by the stage bound to this buffer, which has just run for
                # the same batch (its bucket's rows, padded ones included).
                continue
            if key in self.bound:  # its padding is another stage's to keep: never copied into
                raise ValueError(
                    f"{self.name}: input {key} is bound to another stage's "
                    "buffer and must arrive in it, written by its producer"
                )
            static[:bs].copy_(value.reshape(bs, *static.shape[1:]))
            if self.filled > bs:  # rows of an earlier, larger batch: back to the dummies
                static[bs : self.filled].fill_(self.pads[key])
        self.filled = bs
        return self._replay(bs, bucket, committed_lens_cpu)

    def _replay(self, bs: int, bucket: int, committed_lens_cpu: list[int]) -> Out:
        """The bucket's graph on the static inputs (eager when not captured); output views."""
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            self._run(bucket, [*committed_lens_cpu, *[0] * (bucket - bs)])
        if self.outputs is None:  # a stage that returns None
            return None
        views = {
            key: out[: self.output_rows[key](bucket)]
            if key in self.output_rows
            else out[: bs * self.rows_per_req[key]]
            for key, out in self.outputs.items()
        }
        return self.output_type(**views, **self.absent)

    def _run(self, bucket: int, committed_lens_cpu: list[int]) -> None:
        """The stage on the bucket's static inputs, its results copied to the static outputs."""
        if self.host_inputs:  # flat: up to width values per request of the bucket
            views = {
                key: buffer[: bucket * self.widths[key]] for key, buffer in self.buffers.items()
            }
        else:
            views = {key: buffer[:bucket] for key, buffer in self.buffers.items()}
        result = self.fn(bucket, self.input_type(**views), committed_lens_cpu)
        if result is None:
            return
        if self.outputs is None:
            self._make_outputs(result, bucket)
        assert self.outputs is not None
        for key, out in self.outputs.items():
            value = getattr(result, key)
            static = out[: value.shape[0]]
            if value.data_ptr() != static.data_ptr():  # (else the stage wrote it in place)
                static.copy_(value)

    def _make_outputs(self, result: Any, bucket: int) -> None:
        """Static outputs, by field, for the tensors of `fn`'s first result: the given
        `output_buffers`, else buffers of their own."""
        produced = tensor_fields(result)
        self.output_type = type(result)
        self.absent = {f.name: None for f in dataclasses.fields(result) if f.name not in produced}
        given = {} if self.output_buffers is None else tensor_fields(self.output_buffers)
        if set(given) - set(produced) or set(self.output_rows) - set(produced):
            raise ValueError(
                f"{self.name}: outputs {sorted({*given, *self.output_rows} - set(produced))} "
                f"bound or sized, but {self.output_type.__name__} does not produce them"
            )
        self.outputs = {}
        for key, value in produced.items():
            if key in self.output_rows:
                rows = self.output_rows[key](self.max_bs)
            elif value.shape[0] % bucket:
                raise ValueError(
                    f"{self.name}: output {key} has {value.shape[0]} rows, "
                    f"not a multiple of the batch size {bucket}"
                )
            else:
                self.rows_per_req[key] = value.shape[0] // bucket
                rows = self.max_bs * self.rows_per_req[key]
            if key in given:
                self.outputs[key] = given[key].view(rows, *value.shape[1:])
            else:
                self.outputs[key] = torch.empty(
                    (rows, *value.shape[1:]), dtype=value.dtype, device=value.device
                )

    def capture_all(self, pool=None) -> None:
        """Capture every bucket up to capture_max_bs (the larger ones replay eagerly)."""
        self.captures = True
        buckets = [b for b in self.buckets if b <= self.capture_max_bs]
        if not buckets:
            return
        self.graphs = capture_buckets(
            buckets,
            lambda bs: self._run(bs, [0] * bs),
            self.device,
            f"{self.name}, batch sizes",
            pool,
        )
