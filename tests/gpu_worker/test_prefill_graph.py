"""Prefill graphs: token buckets, padding (tokens to slot 0, requests to row 0 with no tokens),
static outputs, and the worker's use of them.

On CPU the padded path runs eagerly on the same buffers (what CI covers) and must give what
the unpadded eager forward gives; on CUDA the buckets are captured and replayed."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs.forward_graph import PrefillGraphs, requests_for, token_buckets
from gpu_worker.step.forward_batch import ForwardMode
from gpu_worker.step.host_batch import HostBatch
from tests.devices import skip_unless_triton_runs_on
from tests.gpu_worker.runner_utils import runner_from_options, shuffled_slots


def devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def test_buckets_and_what_each_holds():
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(0) == []
    assert [requests_for(t) for t in (16, 64, 1024)] == [16, 64, 64]


def make_runner(model_dir: str, device: str, backend: str):
    if backend == "triton":
        skip_unless_triton_runs_on(device)
    return runner_from_options(
        model_dir,
        device=device,
        page_size=4,
        max_total_tokens=512,
        max_running_requests=8,
        context_length=96,
        attention_backend=backend,
    )


def host_extend(rows, committed_lens, chunks, slots) -> HostBatch:
    new_slots = [s[p : p + len(c)] for s, p, c in zip(slots, committed_lens, chunks, strict=True)]
    return HostBatch.from_requests(ForwardMode.EXTEND, chunks, committed_lens, new_slots, rows)


def write_slots(runner, host: HostBatch) -> None:
    device = runner.device
    prefix = host.seq_lens - host.extend_seq_lens
    runner.req_to_token_pool.write(
        torch.tensor(host.rows, device=device),
        torch.tensor(prefix, device=device),
        torch.tensor(host.out_cache_loc, device=device),
        torch.tensor(host.extend_seq_lens, device=device),
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_padded_prefills_give_the_eager_outputs_and_touch_only_their_slots(
    tiny_dirs, device, backend
):
    if device == "cuda" and backend == "torch_native":
        pytest.skip("torch_native is never captured")
    graphed = make_runner(tiny_dirs["llama"], device, backend)
    eager = make_runner(tiny_dirs["llama"], device, backend)
    graphs = PrefillGraphs(graphed, 40, capture=device == "cuda", keep_hidden=True)
    assert graphs.stage.buckets == [16, 32, 40] and bool(graphs.stage.graphs) == (device == "cuda")
    slots = shuffled_slots(graphed, 4, 60, seed=3)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 200, (n,), generator=gen).tolist()

    steps = [  # (rows, prefix lens, chunk lengths): bucket 16, then 40, then 32
        ([1], [0], [7]),  # one short prompt, padded to 16 tokens and 16 requests
        ([2, 1, 3], [0, 7, 0], [20, 9, 11]),  # a chunk after a cached prefix among prompts
        ([4, 2], [0, 20], [16, 16]),  # whole blocks of the attention kernel
    ]
    for rows, prefix, lens in steps:
        chunks = [ids(n) for n in lens]
        host = host_extend(rows, prefix, chunks, [slots[r - 1] for r in rows])
        assert graphs.can_run(host)
        for runner in (graphed, eager):
            write_slots(runner, host)
        before = [b.clone() for b in graphed.kv_pool.get_kv(1)]
        batch, out = graphs.run(host)
        ref = eager.forward(host.to_device(eager.device))
        assert batch.batch_size == len(rows) and batch.num_tokens == sum(lens)
        assert batch.seq_lens.tolist() == host.seq_lens.tolist()
        assert batch.input_ids.tolist() == host.input_ids.tolist()
        tol = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.next_token_logits, ref.next_token_logits, **tol)
        torch.testing.assert_close(out.hidden_states, ref.hidden_states, **tol)
        # The same KV in the real slots; padded tokens write the dummy slot 0 only.
        for got, want, old in zip(
            graphed.kv_pool.get_kv(1), eager.kv_pool.get_kv(1), before, strict=True
        ):
            changed = set(torch.nonzero((got != old).flatten(1).any(1)).flatten().tolist())
            assert changed <= {*host.out_cache_loc.tolist(), 0}
            loc = torch.tensor(host.out_cache_loc, device=got.device)
            torch.testing.assert_close(got[loc], want[loc], **tol)


@pytest.mark.parametrize("device", devices())
def test_batches_no_bucket_holds_are_refused(tiny_dirs, device):
    runner = make_runner(tiny_dirs["llama"], device, "torch_native")
    graphs = PrefillGraphs(runner, 16, capture=False)
    slots = shuffled_slots(runner, 4, 40, seed=1)
    too_long = host_extend([1], [0], [[5] * 17], slots[:1])
    fits = host_extend([1, 2], [0, 0], [[5] * 8, [6] * 8], slots[:2])
    decode = HostBatch.from_requests(ForwardMode.DECODE, [[5]], [3], [[slots[0][3]]], [1])
    assert not graphs.can_run(too_long) and graphs.can_run(fits) and not graphs.can_run(decode)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefillGraphs(runner, 0, capture=False)
