"""ModelRunner against HF transformers: prefill, chunked prefill over shuffled pages, decode,
mixed batches, tree (custom mask) attention, dummy weights and KV sizing."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.step.forward_batch import ForwardMode
from tests.devices import skip_unless_triton_runs_on
from tests.gpu_worker.checkpoints import reference_logits
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots

ATOL = 1e-4


@pytest.fixture(params=["torch_native", "triton"])
def backend(request) -> str:
    """Every runner test runs with both attention backends (and the layer kernels that come
    with them): triton in the interpreter on CPU."""
    return request.param


def make_runner(model_dir: str, page_size: int = 1, **kwargs) -> ModelRunner:
    if kwargs.get("attention_backend") == "triton":
        skip_unless_triton_runs_on("cpu")
    options = dict(max_total_tokens=256, max_running_requests=4, context_length=128)
    return runner_from_options(model_dir, page_size=page_size, **{**options, **kwargs})


def prompt(length: int, seed: int = 0, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def all_logits(runner: ModelRunner, out) -> torch.Tensor:
    return runner.model.compute_logits(out.hidden_states)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3", "llama_sharded"])
def test_prefill_matches_hf(backend, tiny_dirs, reference_models, name):
    runner = make_runner(tiny_dirs[name], attention_backend=backend)
    ids = prompt(13)
    slots = shuffled_slots(runner, 1, len(ids))
    out = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids], slots)
    expected = reference_logits(reference_models(name), ids)
    assert out.next_token_logits.shape == (1, 256)
    torch.testing.assert_close(out.next_token_logits[0], expected[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(all_logits(runner, out), expected, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_hf(backend, tiny_dirs, reference_models):
    """Positions beyond original_max_position_embeddings (32) exercise the llama3 scaling."""
    runner = make_runner(tiny_dirs["llama31"], attention_backend=backend)
    assert runner.config.rope_scaling["rope_type"] == "llama3"
    ids = prompt(70, seed=3)
    out = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(runner, 1, 70))
    expected = reference_logits(reference_models("llama31"), ids)
    torch.testing.assert_close(all_logits(runner, out), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_then_decode_matches_hf(backend, tiny_dirs, reference_models, page_size):
    runner = make_runner(tiny_dirs["qwen3"], page_size=page_size, attention_backend=backend)
    ids = prompt(18, seed=1)
    num_decode = 5
    slots = shuffled_slots(runner, 1, len(ids) + num_decode, seed=page_size)
    row = 3
    chunk_logits = []
    for start in range(0, len(ids), 4):
        out = run_step(runner, ForwardMode.EXTEND, [row], [start], [ids[start : start + 4]], slots)
        chunk_logits.append(all_logits(runner, out))
    reference = reference_models("qwen3")
    torch.testing.assert_close(
        torch.cat(chunk_logits), reference_logits(reference, ids), atol=ATOL, rtol=0
    )
    seq = list(ids)
    last = out.next_token_logits[0]
    for _ in range(num_decode):
        seq.append(int(last.argmax()))
        out = run_step(runner, ForwardMode.DECODE, [row], [len(seq) - 1], [seq[-1:]], slots)
        last = out.next_token_logits[0]
        torch.testing.assert_close(last, reference_logits(reference, seq)[-1], atol=ATOL, rtol=0)


def test_mixed_batch_of_different_lengths(backend, tiny_dirs, reference_models):
    """Several requests on arbitrary rows, different prefix and extend lengths, one forward."""
    runner = make_runner(tiny_dirs["qwen2"], page_size=4, attention_backend=backend)
    reference = reference_models("qwen2")
    prompts = [prompt(n, seed=10 + n) for n in (9, 3, 14)]
    rows = [2, 4, 1]
    slots = shuffled_slots(runner, 3, 20, seed=7)
    committed_lens = [5, 0, 11]
    # Earlier chunks, one request at a time.
    for row, p, ids, s in zip(rows, committed_lens, prompts, slots, strict=True):
        if p:
            run_step(runner, ForwardMode.EXTEND, [row], [0], [ids[:p]], [s])
    out = run_step(
        runner,
        ForwardMode.EXTEND,
        rows,
        committed_lens,
        [ids[p:] for ids, p in zip(prompts, committed_lens, strict=True)],
        slots,
    )
    for i, ids in enumerate(prompts):
        expected = reference_logits(reference, ids)[-1]
        torch.testing.assert_close(out.next_token_logits[i], expected, atol=ATOL, rtol=0)
    # One batched decode step for all three.
    seqs = [ids + [int(out.next_token_logits[i].argmax())] for i, ids in enumerate(prompts)]
    out = run_step(
        runner, ForwardMode.DECODE, rows, [len(s) - 1 for s in seqs], [s[-1:] for s in seqs], slots
    )
    assert out.next_token_logits.shape == (3, 256)
    for i, seq in enumerate(seqs):
        expected = reference_logits(reference, seq)[-1]
        torch.testing.assert_close(out.next_token_logits[i], expected, atol=ATOL, rtol=0)


def test_custom_mask_causal_equals_causal_path(backend, tiny_dirs):
    runner = make_runner(tiny_dirs["llama"], attention_backend=backend)
    ids = prompt(12, seed=4)
    slots = shuffled_slots(runner, 1, 12)
    run_step(runner, ForwardMode.EXTEND, [1], [0], [ids[:7]], slots)
    causal = run_step(runner, ForwardMode.TARGET_VERIFY, [1], [7], [ids[7:]], slots)
    mask = torch.ones(1, 5, 5, dtype=torch.bool).tril()  # over the 5 new keys: causal
    masked = run_step(
        runner, ForwardMode.TARGET_VERIFY, [1], [7], [ids[7:]], slots, custom_mask=mask
    )
    assert causal.next_token_logits.shape == (5, 256)
    torch.testing.assert_close(masked.next_token_logits, causal.next_token_logits, atol=0, rtol=0)


def test_tree_mask_branch_equals_running_branch_alone(backend, tiny_dirs, reference_models):
    """Tree after a 6-token prefix: root r, children a and b, c under b (nodes r, a, b, c).
    Masking the other branch must give each node the logits of its own path run alone."""
    runner = make_runner(tiny_dirs["llama"], attention_backend=backend)
    reference = reference_models("llama")
    prefix = prompt(6, seed=5)
    r, a, b, c = 11, 22, 33, 44
    parents = [-1, 0, 0, 2]
    depth = [0, 1, 1, 2]
    slots = shuffled_slots(runner, 1, 10)
    run_step(runner, ForwardMode.EXTEND, [1], [0], [prefix], slots)
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)  # tree-local: the prefix is always seen
    for node in range(4):
        ancestor = node
        while ancestor != -1:
            mask[0, node, ancestor] = True
            ancestor = parents[ancestor]
    out = run_step(
        runner,
        ForwardMode.TARGET_VERIFY,
        [1],
        [6],
        [[r, a, b, c]],
        slots,
        custom_mask=mask,
        positions=[[6 + d for d in depth]],
    )
    paths = {0: [r], 1: [r, a], 2: [r, b], 3: [r, b, c]}
    for node, path in paths.items():
        expected = reference_logits(reference, prefix + path)[-1]
        torch.testing.assert_close(out.next_token_logits[node], expected, atol=ATOL, rtol=0)


def test_dummy_load_needs_no_weight_files(tmp_path, tiny_dirs):
    model_dir = tmp_path / "config_only"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(open(f"{tiny_dirs['qwen3']}/config.json").read())
    first = make_runner(str(model_dir), load_format="dummy", seed=7)
    second = make_runner(str(model_dir), load_format="dummy", seed=7)
    other = make_runner(str(model_dir), load_format="dummy", seed=8)
    ids = prompt(5)
    logits = []
    for runner in (first, second, other):
        out = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids], shuffled_slots(runner, 1, 5))
        logits.append(out.next_token_logits)
    assert torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    assert not torch.allclose(logits[0], logits[2])
    norm = first.model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    with pytest.raises(Exception, match="safetensors"):
        make_runner(str(model_dir))


def test_kv_pool_sizing_on_cpu(tiny_dirs):
    runner = make_runner(
        tiny_dirs["llama"],
        page_size=8,
        max_total_tokens=None,
        max_running_requests=3,
        context_length=100,
    )
    # The 1 GiB CPU budget is far above 3 * 100 tokens, so the cap applies, rounded to pages.
    assert runner.max_total_tokens == 296
    assert runner.kv_pool.k_buffers[0].shape[0] == 296 + 8
    explicit = make_runner(tiny_dirs["llama"], page_size=8, max_total_tokens=61)
    assert explicit.max_total_tokens == 56
    assert explicit.req_to_token_pool.req_to_token.shape == (5, 128)


def test_one_token_runs_the_fused_layer_kernels(tiny_dirs, reference_models, monkeypatch):
    """With the triton backend a forward of one token runs each decoder layer as five kernels
    (norm+qkv, attention, o_proj, norm+gate_up, silu+down), with the same logits; weights over
    the fusion limit take the separate norm and SiLU kernels and the kernel without a prologue
    (the GEMV), or the library GEMM where GEMV_CONFIG is None. Up to pdl.MAX_ROWS tokens (a
    chain's verify) run the fused kernels too; more tokens the library GEMMs."""
    from gpu_worker.kernels import pdl, small_m_linear

    launches = []
    launch = small_m_linear._launch
    monkeypatch.setattr(
        small_m_linear,
        "_launch",
        lambda prologue, *a: launches.append(prologue) or launch(prologue, *a),
    )
    runner = make_runner(tiny_dirs["qwen2"], attention_backend="triton")  # biases on q, k, v
    per_layer = [
        small_m_linear.NORM,
        small_m_linear.PLAIN,
        small_m_linear.ADD_NORM,
        small_m_linear.SILU_MUL,
    ]  # the first layer's stream has no residual yet
    per_layer_later = [small_m_linear.ADD_NORM, *per_layer[1:]]
    expected_fused = per_layer + per_layer_later * (runner.config.num_layers - 1)
    gemv = small_m_linear.GEMV_CONFIG
    expected_gemv = [small_m_linear.PLAIN] * 4 * runner.config.num_layers
    rows = pdl.MAX_ROWS
    for length, fuse, gemv_config, expected in (
        (1, True, gemv, expected_fused),
        (rows, True, gemv, expected_fused),
        (rows + 1, True, gemv, []),
        (1, False, gemv, expected_gemv),
        (1, False, None, []),
    ):
        monkeypatch.setattr(small_m_linear, "MAX_FUSED_WEIGHT", 4 << 20 if fuse else 0)
        monkeypatch.setattr(small_m_linear, "GEMV_CONFIG", gemv_config)
        launches.clear()
        ids = prompt(length, seed=length)
        slots = shuffled_slots(runner, 1, length)
        out = run_step(runner, ForwardMode.EXTEND, [1], [0], [ids], slots)
        reference = reference_logits(reference_models("qwen2"), ids)
        torch.testing.assert_close(all_logits(runner, out), reference, atol=ATOL, rtol=0)
        assert launches == expected
