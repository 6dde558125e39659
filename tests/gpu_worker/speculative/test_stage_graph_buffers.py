"""`StageGraph`'s buffers without a model: padding to the dummy row, outputs handed to the
next stage without copies, buckets past the captured ones, inputs from the host in one copy.
On CPU the padded path runs eagerly; on CUDA (AERIE_SPEC_TEST_DEVICE=cuda) it is captured."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from gpu_worker.graphs.stage_graph import StageGraph, StageInput, tensor_fields
from tests.gpu_worker.speculative.test_eagle_worker import DEVICE


@dataclass(frozen=True)
class Rows:
    rows: torch.Tensor


@dataclass(frozen=True)
class Batch:
    rows: torch.Tensor
    committed_lens: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class Result:
    out: torch.Tensor
    pair: torch.Tensor


@dataclass(frozen=True)
class XY:
    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class XYOwn:
    x: torch.Tensor
    y: torch.Tensor
    own: torch.Tensor | None = None


@dataclass(frozen=True)
class XZ:
    x: torch.Tensor | None
    z: torch.Tensor


@dataclass(frozen=True)
class Z:
    z: torch.Tensor


@dataclass(frozen=True)
class Out:
    out: torch.Tensor


def test_stage_graph_pads_with_the_dummy_row_and_resets_old_rows():
    seen = []

    def fn(bs, inputs, seq_cpu):
        seen.append((bs, inputs.rows.tolist(), list(seq_cpu)))
        return Result(out=inputs.rows * 10 + inputs.committed_lens, pair=inputs.tokens.flatten())

    specs = {
        "rows": StageInput(),
        "committed_lens": StageInput(),
        "tokens": StageInput((2,), pad=7),
    }
    stage = StageGraph("test", fn, Batch, specs, 6, torch.device("cpu"), capture=False)
    assert stage.buckets == [1, 2, 4, 6]
    out = stage(
        Batch(
            rows=torch.tensor([3, 1, 2, 5, 4]),
            committed_lens=torch.tensor([9] * 5),
            tokens=torch.arange(10).view(5, 2),
        ),
        [9] * 5,
    )
    assert isinstance(out, Result)
    assert out.out.tolist() == [39, 19, 29, 59, 49]
    assert out.pair.tolist() == list(range(10))
    assert seen[-1] == (6, [3, 1, 2, 5, 4, 0], [9] * 5 + [0])  # padded to row 0, length 0
    out = stage(
        Batch(
            rows=torch.tensor([8, 6]),
            committed_lens=torch.tensor([1, 2]),
            tokens=torch.ones(2, 2, dtype=torch.int64),
        ),
        [1, 2],
    )
    assert out.out.tolist() == [81, 62] and out.pair.tolist() == [1] * 4
    assert seen[-1] == (2, [8, 6], [1, 2])
    # The rows the larger batch left behind are back to the dummies.
    assert stage.inputs.rows.tolist() == [8, 6, 0, 0, 0, 0]
    assert stage.inputs.tokens[2:].eq(7).all()
    big = stage(
        Batch(
            rows=torch.arange(1, 8),
            committed_lens=torch.zeros(7, dtype=torch.int64),
            tokens=torch.zeros(7, 2, dtype=torch.int64),
        ),
        [0] * 7,
    )
    assert big.out.tolist() == [10 * r for r in range(1, 8)] and seen[-1][0] == 7  # direct


def test_specs_and_bindings_name_fields_of_the_stage_types():
    """A spec, an input binding or an output binding that names no field of the stage's types
    is refused when the stage is made (or, for outputs, at its first run)."""
    cpu = torch.device("cpu")

    def fn(bs, inputs, seq_cpu):
        return XZ(x=None, z=inputs.rows + 1)

    with pytest.raises(ValueError, match="are not the fields of Rows"):
        StageGraph("typo", fn, Rows, {"row": StageInput()}, 4, cpu, capture=False)
    with pytest.raises(ValueError, match=r"no inputs \['x'\] to bind"):
        StageGraph(
            "unknown",
            fn,
            Rows,
            {"rows": StageInput()},
            4,
            cpu,
            capture=False,
            input_buffers={"x": torch.zeros(4, dtype=torch.int64)},
        )
    stage = StageGraph(
        "absent",
        fn,
        Rows,
        {"rows": StageInput()},
        4,
        cpu,
        capture=False,
        output_buffers=XZ(x=torch.zeros(4, dtype=torch.int64), z=torch.zeros(4, dtype=torch.int64)),
    )
    with pytest.raises(ValueError, match=r"outputs \['x'\] bound or sized, but XZ"):
        stage(Rows(torch.tensor([1, 2])), [0] * 2)


def count_copies(monkeypatch) -> list[torch.Size]:
    """From now on, the shape of every tensor `copy_` writes into, in order."""
    copies = []
    original = torch.Tensor.copy_

    def counting(self, *args, **kwargs):
        copies.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    return copies


def test_chained_stages_hand_over_outputs_without_copies(monkeypatch):
    """A stage whose outputs are bound to the next stage's inputs writes them there; passing
    them on copies nothing, and padded rows carry what the first stage computed for the dummy."""
    seen = []

    def second_fn(bs, inputs, seq_cpu):
        seen.append((bs, inputs.x.tolist(), inputs.y.tolist()))

    second = StageGraph(
        "second",
        second_fn,
        XY,
        {"x": StageInput(), "y": StageInput((2,))},
        4,
        torch.device("cpu"),
        capture=False,
    )

    def first_fn(bs, inputs, seq_cpu):
        rows = inputs.rows
        return XYOwn(x=rows + 100, y=torch.stack([rows, -rows], dim=1), own=rows * 2)

    first = StageGraph(
        "first",
        first_fn,
        Rows,
        {"rows": StageInput()},
        4,
        torch.device("cpu"),
        capture=False,
        output_buffers=XYOwn(x=second.inputs.x, y=second.inputs.y),
    )
    out = first(Rows(torch.tensor([5, 6, 7])), [0] * 3)
    assert out.x.data_ptr() == second.inputs.x.data_ptr()
    assert out.own.data_ptr() != second.inputs.x.data_ptr()
    copies = count_copies(monkeypatch)
    assert second(XY(out.x, out.y), [0] * 3) is None
    assert copies == []
    # bucket 4: the padded row holds what the first stage made of the dummy row 0
    assert seen[-1] == (4, [105, 106, 107, 100], [[5, -5], [6, -6], [7, -7], [0, 0]])
    second(XY(torch.tensor([1, 2]), out.y[:2].clone()), [0] * 2)  # copied in
    assert len(copies) == 2 and seen[-1][1] == [1, 2]


def test_an_output_the_stage_wrote_into_its_buffer_is_not_copied(monkeypatch):
    """A stage may write a bound output itself (the fused greedy acceptance writes the extend
    stage's inputs): the call then copies nothing for it, and the buffer holds what it wrote;
    an output computed elsewhere is still copied in."""
    target = torch.zeros(4, 2, dtype=torch.int64)

    def fn(bs, inputs, seq_cpu):
        rows = inputs.rows
        torch.stack([rows, rows + 1], dim=1, out=target[:bs])  # in place, as a kernel would
        return XZ(x=target[:bs], z=rows * 3)

    stage = StageGraph(
        "in place",
        fn,
        Rows,
        {"rows": StageInput()},
        4,
        torch.device("cpu"),
        capture=False,
        output_buffers=XZ(x=target, z=torch.zeros(4, dtype=torch.int64)),
    )
    rows = torch.tensor([5, 6, 7, 0])  # already the bucket's size: no input copy either
    stage.inputs.rows.copy_(rows)
    copies = count_copies(monkeypatch)
    out = stage(Rows(stage.inputs.rows[:3]), [0] * 3)
    assert copies == [torch.Size([4])]  # z only
    assert out.x.tolist() == [[5, 6], [6, 7], [7, 8]] and out.z.tolist() == [15, 18, 21]


def test_stages_bound_to_one_producer_share_its_outputs_without_copies(monkeypatch):
    """Alternative consumers (the accept variants) bind their inputs to the same buffers
    (`input_buffers`): the producer writes them once and either consumer reads them in
    place; a bound input passed from elsewhere, or a buffer of the wrong shape or dtype, is
    refused."""
    seen = []

    def consumer(name):
        def fn(bs, inputs, seq_cpu):
            seen.append((name, bs, inputs.x.tolist(), inputs.y.tolist()))
            return Z(inputs.x * 2)

        return fn

    specs = {"x": StageInput(), "y": StageInput((2,), torch.int32)}
    cpu = torch.device("cpu")
    first = StageGraph("first", consumer("a"), XY, specs, 4, cpu, capture=False)
    second = StageGraph(
        "second",
        consumer("b"),
        XY,
        specs,
        4,
        cpu,
        capture=False,
        input_buffers=tensor_fields(first.inputs),
    )
    assert second.inputs.x is first.inputs.x and second.inputs.y is first.inputs.y

    def make(bs, inputs, seq_cpu):
        rows = inputs.rows
        return XY(x=rows + 1, y=torch.stack([rows, rows], 1).int())

    producer = StageGraph(
        "producer",
        make,
        Rows,
        {"rows": StageInput()},
        4,
        cpu,
        capture=False,
        output_buffers=first.inputs,
    )
    out = producer(Rows(torch.tensor([4, 5, 6])), [0] * 3)
    copies = count_copies(monkeypatch)
    for stage in (second, first):
        z = stage(out, [0] * 3).z
        assert z.tolist() == [10, 12, 14]
    assert copies == [torch.Size([4])] * 2  # each stage's own output (its bucket), no input
    assert [s[0] for s in seen] == ["b", "a"]
    assert seen[0][1:] == (4, [5, 6, 7, 1], [[4, 4], [5, 5], [6, 6], [0, 0]])
    with pytest.raises(ValueError, match="input x is bound to another stage's buffer"):
        second(XY(torch.tensor([1, 2]), out.y[:2]), [0] * 2)  # not in place
    with pytest.raises(ValueError, match="input y is bound to a torch.int64 tensor"):
        StageGraph(
            "wrong",
            consumer("c"),
            XY,
            specs,
            4,
            cpu,
            capture=False,
            input_buffers={"y": torch.zeros(4, 2, dtype=torch.int64)},
        )


@pytest.mark.skipif(DEVICE != "cuda", reason="graphs are captured on CUDA only")
def test_buckets_past_capture_max_bs_run_eagerly_on_the_static_buffers():
    """A stage captured up to capture_max_bs replays graphs up to there and runs the larger
    buckets' padded path eagerly, with the same inputs, outputs and results."""

    def fn(bs, inputs, seq_cpu):
        return Out(inputs.rows * 3 + 1)

    stage = StageGraph(
        "partial",
        fn,
        Rows,
        {"rows": StageInput()},
        16,
        torch.device("cuda"),
        capture=True,
        capture_max_bs=4,
    )
    assert sorted(stage.graphs) == [1, 2, 4]
    for rows in ([2, 3], [1, 2, 3, 4, 5, 6], list(range(1, 17)), [7]):
        out = stage(Rows(torch.tensor(rows, device="cuda")), [0] * len(rows))
        assert out.out.tolist() == [3 * r + 1 for r in rows]
    assert stage.inputs.rows[1:].eq(0).all()  # the larger batches' rows are padding again


@dataclass(frozen=True)
class Slots:
    rows: np.ndarray | torch.Tensor
    index: np.ndarray | torch.Tensor
    value: np.ndarray | torch.Tensor


def test_host_inputs_go_over_in_one_copy_padded_and_flat(monkeypatch):
    """A stage fed from the host gets its inputs flat, padded to its bucket with each input's
    pad (every call rewrites the whole buffer, so nothing of a larger batch is left), int32
    inputs as int32, all in one upload; values beyond the bucket are refused, and a batch past
    max_bs runs directly on exactly the values given."""
    seen = []

    def fn(bs, inputs, seq_cpu):
        seen.append(
            (
                bs,
                inputs.rows.tolist(),
                inputs.index.tolist(),
                inputs.value.tolist(),
                inputs.value.dtype,
            )
        )
        return Out(inputs.rows * 10)

    specs = {
        "rows": StageInput(),
        "index": StageInput((2,), pad=-1),
        "value": StageInput((2,), torch.int32, pad=3),
    }
    cpu = torch.device("cpu")
    stage = StageGraph("host", fn, Slots, specs, 6, cpu, capture=False, host_inputs=True)
    uploads = []
    upload_into = stage.staging.upload_into
    monkeypatch.setattr(
        stage.staging, "upload_into", lambda *args: uploads.append(args) or upload_into(*args)
    )
    int64, int32 = np.int64, np.int32
    out = stage.call_host(
        3,
        Slots(
            rows=np.array([3, 1, 2], int64),
            index=np.array([11, 12, 13, 14, 15], int64),
            value=np.array([7, 8, 9, 10, 11], int32),
        ),
    )
    assert out.out.tolist() == [30, 10, 20] and len(uploads) == 1
    assert seen[-1] == (
        4,
        [3, 1, 2, 0],
        [11, 12, 13, 14, 15, -1, -1, -1],
        [7, 8, 9, 10, 11, 3, 3, 3],
        torch.int32,
    )
    assert stage.capacity(3) == 4 and stage.capacity(6) == 6 and stage.capacity(7) is None
    out = stage.call_host(1, Slots(np.array([5], int64), np.zeros(0, int64), np.zeros(0, int32)))
    assert out.out.tolist() == [50] and len(uploads) == 2
    assert seen[-1] == (1, [5], [-1, -1], [3, 3], torch.int32)
    assert stage.inputs.rows.tolist() == [5, 0, 0, 0, 0, 0]  # the batch of 3 is gone
    assert stage.inputs.value.tolist() == [3] * 12
    with pytest.raises(ValueError, match="3 values of index for a batch of 1"):
        stage.call_host(1, Slots(np.array([5], int64), np.arange(3), np.zeros(0, int32)))
    big = stage.call_host(7, Slots(np.arange(1, 8), np.arange(20, 23), np.array([4, 5, 6], int32)))
    assert big.out.tolist() == [10 * r for r in range(1, 8)]
    assert seen[-1] == (7, list(range(1, 8)), [20, 21, 22], [4, 5, 6], torch.int32)
