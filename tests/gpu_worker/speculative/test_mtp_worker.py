"""Multi-layer EAGLE (MTP) in the GPU worker, driven by the real scheduler core in process.

Greedy output equals the target's own; an MTP stack that always agrees with its
target is accepted in full; every forward of layer k uses runner k's pools, and layers >= 1
recompute their boundary KV from the true tokens: each layer's KV at the committed
positions equals a one-shot recomputation over the final sequence.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.mtp_checkpoints import (
    make_agreeing_mtp_target,
    make_tiny_mtp_dir,
    make_tiny_mtp_target,
)
from tests.gpu_worker.speculative.test_eagle_worker import (
    make_config,
    on_cpu_only,
    random_prompts,
    run_engine,
    serve,
)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp-models")
    target = make_tiny_mtp_target(str(root / "target"), num_mtp_layers=3)
    plain = make_tiny_checkpoint(
        str(root / "plain"), "llama", vocab_size=384, max_position_embeddings=512
    )
    return {
        "target": target,
        "plain": plain,
        "separate": make_tiny_mtp_dir(str(root / "separate"), plain, num_mtp_layers=2),
        "agreeing": make_agreeing_mtp_target(str(root / "agreeing"), num_mtp_layers=3),
    }


def mtp_config(target, steps, draft=None, page_size=1, chunk=64):
    return make_config(target, "MTP", draft, steps, 1, steps + 1, page_size, chunk)


@pytest.mark.parametrize("steps, page_size, chunk", [(1, 1, 64), (2, 4, 3), (3, 1, 4), (3, 4, 64)])
def test_mtp_greedy_equals_target_greedy(mtp_models, steps, page_size, chunk):
    prompts = random_prompts(seed=steps + page_size)
    base, _, _ = run_engine(make_config(mtp_models["target"], page_size=page_size), prompts, 20)
    spec, verify_ct, counts = run_engine(
        mtp_config(mtp_models["target"], steps, page_size=page_size, chunk=chunk), prompts, 20
    )
    assert spec == base
    assert all(1 <= n <= steps + 1 for n in counts) and all(v > 0 for v in verify_ct.values())


def test_mtp_layers_from_a_separate_directory(mtp_models):
    prompts = random_prompts(seed=4)
    base, _, _ = run_engine(make_config(mtp_models["plain"]), prompts, 12)
    spec, _, _ = run_engine(mtp_config(mtp_models["plain"], 2, mtp_models["separate"]), prompts, 12)
    assert spec == base


def test_agreeing_mtp_stack_is_accepted_in_full(mtp_models):
    steps = 3
    config = mtp_config(mtp_models["agreeing"], steps)
    prompts = random_prompts(seed=6)
    outputs, verify_ct, counts = run_engine(config, prompts, 1 + 4 * (steps + 1))
    assert counts and all(n == steps + 1 for n in counts)
    assert all(v == 4 for v in verify_ct.values())
    assert outputs == run_engine(make_config(mtp_models["agreeing"]), prompts, 17)[0]


def test_verify_counts_do_not_depend_on_prefill_chunking(mtp_models):
    prompts = random_prompts(seed=12)
    runs = [
        run_engine(mtp_config(mtp_models["target"], 3, chunk=c), prompts, 16)[:2] for c in (3, 64)
    ]
    assert runs[0] == runs[1]


def layer_kv(worker: GPUWorker, row: int, length: int) -> list[torch.Tensor]:
    """Layer-0 K of every MTP runner at a row's first `length` positions, via its own pool."""
    out = []
    for runner in worker.draft_runner_list:
        slots = runner.req_to_token_pool.req_to_token[row, :length].long()
        out.append(runner.kv_pool.get_kv(0)[0][slots].clone())
    return out


def serve_one(config, prompt: list[int], max_new: int) -> tuple[GPUWorker, int, list[int]]:
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    row, output, _ = serve(sched, worker, prompt, max_new)
    return worker, row, output


@pytest.mark.parametrize("chunk", [3, 64])
def test_each_layer_uses_its_own_pool_and_recomputes_boundary_kv(mtp_models, chunk):
    """After chunked prefill and many partially accepted verify steps, layer k's KV at every
    position p whose input token t_{p+1+k} is known equals a one-shot prefill of the final
    sequence: no forward wrote another runner's pool, and no stale predicted-token KV stayed
    at a boundary (SGLang #22954 and the multi-layer boundary-KV fix)."""
    steps = 3
    prompt = random_prompts(seed=21, n=1)[0] + list(range(40, 50))
    worker, row, output = serve_one(
        mtp_config(mtp_models["target"], steps, chunk=chunk), prompt, 24
    )
    sequence = prompt + output
    m = len(sequence) - 1  # positions 0..m-1 have their next token inside `sequence`
    reference, ref_row, _ = serve_one(mtp_config(mtp_models["target"], steps), sequence[:m], 1)
    got, want = layer_kv(worker, row, m), layer_kv(reference, ref_row, m)
    for k in range(steps):
        known = m - 1 - k  # positions p <= m-1-k read t_{p+1+k} from the sequence
        torch.testing.assert_close(
            got[k][: known + 1], want[k][: known + 1], atol=1e-5, rtol=1e-5, msg=f"MTP layer {k}"
        )


@pytest.mark.parametrize("chunk", [3, 64])
def test_a_cached_prefix_leaves_every_layers_kv_as_a_full_prefill_makes_it(mtp_models, chunk):
    """A second turn reuses the first turn's cached KV (stopping S tokens short of the match)
    and prefills only the rest: afterwards every layer's KV at every position whose input
    tokens are known equals a one-shot prefill's, so no prefill window reached back into the
    shared prefix with the row's stale hidden stash."""
    steps = 3
    config = mtp_config(mtp_models["target"], steps, chunk=chunk)
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    first = random_prompts(seed=22, n=1)[0] + list(range(40, 50))
    _, answer, cached = serve(sched, worker, first, 12)
    assert cached == 0
    # Diverge right after the cached tokens: the layers' KV at the last cached positions was
    # made with the first turn's later tokens, not these.
    second = first + answer[:-1] + [answer[-1] + 1, 8, 9, 10, 11]
    row, output, cached = serve(sched, worker, second, 10)
    assert cached == len(first) + len(answer) - 1 - steps
    sequence = second + output
    m = len(sequence) - 1
    uncached = config.replace(cache={"disable_radix_cache": True})
    reference, ref_row, _ = serve_one(uncached, sequence[:m], 1)
    got, want = layer_kv(worker, row, m), layer_kv(reference, ref_row, m)
    for k in range(steps):
        known = m - 1 - k
        torch.testing.assert_close(
            got[k][: known + 1], want[k][: known + 1], atol=1e-5, rtol=1e-5, msg=f"MTP layer {k}"
        )


@on_cpu_only
def test_memory_sized_kv_pools_fit_the_budget_with_mtp_runners(mtp_models, monkeypatch):
    """S one-layer MTP pools share the target's slot count; a memory-sized target pool leaves
    room for all of them."""
    import gpu_worker.model_runner as model_runner

    budget = 1 << 20
    monkeypatch.setattr(model_runner, "CPU_KV_BUDGET_BYTES", budget)
    config = mtp_config(mtp_models["target"], 3).replace(cache={"max_total_tokens": None})
    worker = GPUWorker(config)
    pools = [runner.kv_pool for runner in worker.runners]
    used = sum(sum(t.numel() * t.element_size() for t in p.k_buffers + p.v_buffers) for p in pools)
    assert len(pools) == 4 and used <= budget * 1.01  # + the reserved dummy page
