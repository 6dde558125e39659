"""Tensor parallelism on CPU (gloo): a model sharded over 2 or 4 ranks gives every rank the
logits of the unsharded model (HF's), in prefill and decode, with KV heads split or
replicated, tied embeddings, a vocabulary the ranks do not divide, and both attention
backends (the triton one runs the fused layer path, whose all-reduces are explicit).
AERIE_TP_TEST_DEVICE=cuda runs the same on GPUs over NCCL (rank r on cuda:r, float32)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from aerie import endpoints
from aerie.config import config_from_args
from gpu_worker.parallel import TensorParallel, init_tensor_parallel
from gpu_worker.process import worker_device
from gpu_worker.step.forward_batch import ForwardMode
from gpu_worker.tooling.ranks import run_ranks
from tests.devices import skip_unless_triton_runs_on
from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint, reference_logits
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots

ATOL = 1e-4
DEVICE = os.environ.get("AERIE_TP_TEST_DEVICE", "cpu")


def run_rank(rank, size, address, model_dir, backend, ids) -> tuple:
    """One rank: load its shard, prefill `ids`, decode one token -> (prefill logits, decode
    logits, KV buffer shape)."""
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if DEVICE == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, address, device)
    runner = runner_from_options(
        model_dir,
        tp=tp,
        attention_backend=backend,
        max_total_tokens=256,
        max_running_requests=4,
        context_length=128,
        device=str(device),
    )
    slots = shuffled_slots(runner, 1, len(ids) + 1)
    prefill = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids[:-1]], slots)
    decode = run_step(runner, ForwardMode.DECODE, [1], [len(ids) - 1], [ids[-1:]], slots)
    prefill_logits = runner.model.compute_logits(prefill.hidden_states)
    kv_shape = tuple(runner.kv_pool.k_buffers[0].shape[1:])
    return prefill_logits.cpu().numpy(), decode.next_token_logits.cpu().numpy(), kv_shape


def run_sharded(model_dir: str, size: int, backend: str, ids: list[int]) -> list[tuple]:
    """Every rank's (prefill logits, decode logits, KV buffer shape), in rank order."""
    out = run_ranks(run_rank, size, model_dir, backend, ids)
    return [(torch.from_numpy(p), torch.from_numpy(d), kv) for p, d, kv in out]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    def make(name: str, arch: str, **overrides) -> str:
        return make_tiny_checkpoint(str(tmp_path_factory.mktemp(name)), arch, **overrides)

    return {
        "llama": make("llama", "llama"),
        "qwen3": make("qwen3", "qwen3", head_dim=32, seed=3),
        # 250 ids over 4 ranks: blocks of 63, the last padded; tied: one sharded matrix.
        "tied_odd_vocab": make("tied", "llama", vocab_size=250, tie_word_embeddings=True, seed=1),
    }


@pytest.mark.parametrize(
    "name, size, backend",
    [
        ("llama", 2, "torch_native"),  # 2 of 4 query heads and 1 of 2 KV heads per rank
        ("llama", 4, "torch_native"),  # 1 query head per rank, each KV head on two ranks
        ("qwen3", 2, "torch_native"),  # per-head q/k norm
        ("tied_odd_vocab", 4, "torch_native"),
        ("llama", 2, "triton"),
    ],
)
def test_sharded_model_gives_every_rank_the_unsharded_logits(checkpoints, name, size, backend):
    if DEVICE == "cuda" and torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    if backend == "triton":
        skip_unless_triton_runs_on(DEVICE)
    model_dir = checkpoints[name]
    reference = load_reference(model_dir)
    vocab = reference.config.vocab_size
    ids = [random.Random(size).randrange(vocab) for _ in range(11)]
    expected = reference_logits(reference, ids)  # [11, vocab]
    ranks = run_sharded(model_dir, size, backend, ids)
    kv_heads = reference.config.num_key_value_heads
    for prefill, decode, kv_shape in ranks:
        torch.testing.assert_close(prefill, expected[:-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[0], expected[-1], atol=ATOL, rtol=0)
        assert kv_shape == (max(1, kv_heads // size), reference.config.head_dim)
    for prefill, decode, _ in ranks[1:]:  # every rank samples from the same logits
        assert torch.equal(prefill, ranks[0][0]) and torch.equal(decode, ranks[0][1])


def test_shares_and_their_errors():
    assert TensorParallel(1, 2).split(8, "heads") == (4, 4)
    with pytest.raises(ValueError, match=r"heads \(6\) is not divisible by the TP size \(4\)"):
        TensorParallel(0, 4).split(6, "heads")
    # 2 KV heads over 4 ranks: ranks 0, 1 read head 0; ranks 2, 3 head 1.
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert TensorParallel(1, 2).kv_heads(8) == (4, 4)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        TensorParallel(0, 4).kv_heads(3)
    assert [TensorParallel(r, 4).vocab_block(250) for r in (0, 3)] == [(0, 63), (189, 63)]
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        TensorParallel(2, 2)


@pytest.mark.parametrize(
    "argv, node_rank, expected",
    [
        (["--tp-size", "2", "--dp-size", "2"], 0, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        (["--tp-size", "4", "--nnodes", "2"], 1, ["cuda:0", "cuda:1"]),  # ranks 2, 3 of node 1
        ([], 0, ["cuda"]),  # one GPU: the device as configured
    ],
)
def test_each_worker_gets_its_own_gpu(argv, node_rank, expected):
    config = config_from_args(["--device", "cuda", "--node-rank", str(node_rank), *argv])
    parallel = config.parallel
    ranks = endpoints.node_ranks(config)
    devices = [
        worker_device(config, rank, replica)
        for replica in range(parallel.dp_size)
        for rank in ranks
    ]
    assert devices == expected
