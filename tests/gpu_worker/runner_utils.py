"""Helpers that build a ModelRunner from flat options and drive it the way the worker does:
shuffled pages, chunked extends."""

from __future__ import annotations

import dataclasses
import random

import torch

from gpu_worker.model_runner import ModelRunner, PoolSpec, RunnerSpec
from gpu_worker.step.forward_batch import ForwardMode, build_forward_batch

SPEC_FIELDS = {f.name for f in dataclasses.fields(RunnerSpec)}


def runner_from_options(
    model_dir: str, draft_of: ModelRunner | None = None, **options
) -> ModelRunner:
    """A runner over model_dir from keyword options split into `RunnerSpec` and `PoolSpec`
    fields; a draft (draft_of given) takes its target's pools, so only RunnerSpec options may
    be passed for it."""
    spec = RunnerSpec(model_dir, **{k: v for k, v in options.items() if k in SPEC_FIELDS})
    pool_options = {k: v for k, v in options.items() if k not in SPEC_FIELDS}
    if draft_of is None:
        return ModelRunner(spec, PoolSpec(**pool_options))
    if pool_options:
        raise TypeError(f"a draft takes its target's pools, not {sorted(pool_options)}")
    return ModelRunner(spec, draft_of.pools, draft_of=draft_of)


def shuffled_slots(runner: ModelRunner, num_requests: int, seq_len: int, seed: int = 0):
    """Per request, KV slots for positions 0..seq_len: whole pages taken from a shuffled list
    of the pool's pages (page 0 is never used), so slots are non-contiguous across pages."""
    page_size = runner.page_size
    pages = list(range(1, runner.max_total_tokens // page_size + 1))
    random.Random(seed).shuffle(pages)
    pages_per_request = -(-seq_len // page_size)
    assert pages_per_request * num_requests <= len(pages), "pool too small for the test"
    slots = []
    for i in range(num_requests):
        own = pages[i * pages_per_request : (i + 1) * pages_per_request]
        slots.append([p * page_size + j for p in own for j in range(page_size)][:seq_len])
    return slots


def run_step(
    runner: ModelRunner,
    mode: ForwardMode,
    rows: list[int],
    committed_lens: list[int],
    input_ids: list[list[int]],
    all_slots: list[list[int]],
    custom_mask=None,
    positions=None,
):
    """Write each request's new slots into req_to_token, run one forward, return LogitsOutput."""
    new_slots = [
        s[p : p + len(ids)] for s, p, ids in zip(all_slots, committed_lens, input_ids, strict=True)
    ]
    device = runner.device
    runner.req_to_token_pool.write(
        torch.tensor(rows, device=device),
        torch.tensor(committed_lens, device=device),
        torch.tensor([x for s in new_slots for x in s], device=device),
        torch.tensor([len(s) for s in new_slots], device=device),
    )
    batch = build_forward_batch(
        mode,
        input_ids,
        committed_lens,
        new_slots,
        rows,
        device,
        positions=positions,
        custom_mask=custom_mask,
    )
    return runner.forward(batch)


def prefill_in_chunks(runner, row: int, ids: list[int], slots: list[int], chunk: int):
    """Run ids through the runner in chunks; returns logits [len(ids), V] of every position
    (each chunk's last-token logits only are produced by EXTEND, so run them one by one)."""
    rows_logits = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        out = run_step(runner, ForwardMode.EXTEND, [row], [start], [piece], [slots])
        rows_logits.append(out.next_token_logits[0])
    return torch.stack(rows_logits)
