"""The target side of a speculative step, shared by every draft algorithm: one TARGET_VERIFY
forward over all tree nodes (`verify_tree`) and acceptance (`accept_tree`: greedy, or exact
speculative sampling of the processed target distribution, seeded by the request's seed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.model_runner import LogitsOutput, ModelRunner
from gpu_worker.sampling import (
    STREAM_SPEC_BONUS,
    STREAM_SPEC_COIN,
    SamplingRows,
    SamplingState,
    apply_penalties,
    processed_probs,
    uniform_noise,
)
from gpu_worker.speculative.tree import DraftTree
from gpu_worker.speculative.verify import VerifyResult, verify_greedy, verify_sampling


def make_batch(
    mode: ForwardMode,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens_cpu: list[int],
    extend_lens_cpu: list[int],
    custom_mask: torch.Tensor | None = None,
    spec_info: object | None = None,
) -> ForwardBatch:
    """A ForwardBatch from device tensors; kv_lens = KV length each request attends after it."""
    device = input_ids.device
    prefix_cpu = [kv - n for kv, n in zip(kv_lens_cpu, extend_lens_cpu, strict=True)]

    def small(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return ForwardBatch(
        mode=mode,
        input_ids=input_ids.long(),
        positions=positions.long(),
        out_cache_loc=out_cache_loc.long(),
        req_pool_indices=req_pool_indices.long(),
        seq_lens=small(kv_lens_cpu),
        extend_seq_lens=small(extend_lens_cpu),
        seq_lens_cpu=kv_lens_cpu,
        extend_prefix_lens_cpu=prefix_cpu,
        extend_seq_lens_cpu=extend_lens_cpu,
        custom_mask=custom_mask,
        spec_info=spec_info,
    )


def verify_tree(
    target: ModelRunner,
    tree: DraftTree,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_cpu: list[int],
) -> LogitsOutput:
    """One target forward over all ND nodes of every tree; node k's KV goes to the slot of
    position seq + k (its rotary position is seq + depth)."""
    nd = tree.num_draft_tokens
    offsets = torch.arange(nd, device=seq_lens.device)
    positions = seq_lens.long()[:, None] + offsets  # [bs, ND]
    slots = target.req_to_token_pool.req_to_token[rows.long()[:, None], positions]  # [bs, ND]
    batch = make_batch(
        ForwardMode.TARGET_VERIFY,
        tree.tokens,
        tree.positions,
        slots.flatten(),
        rows,
        [s + nd for s in seq_cpu],
        [nd] * len(seq_cpu),
        custom_mask=tree.custom_mask,
    )
    return target.forward(batch)


def penalize_tree(
    sampling: SamplingState,
    tree: DraftTree,
    logits: torch.Tensor,
    rows: torch.Tensor,
    node_params: SamplingRows,
) -> torch.Tensor:
    """Penalised verify logits [bs*ND, V]: node k is penalised as plain decoding would be after
    emitting the drafts on its own path (its ancestors below the root, and itself), on top of
    the request's outputs so far (which include the root, the previous bonus token)."""
    assert tree.ancestors is not None
    bs, nd, vocab = rows.shape[0], tree.num_draft_tokens, logits.shape[-1]
    index = rows.to(sampling.device, torch.int64)
    drafts = F.one_hot(tree.tokens.view(bs, nd)[:, 1:], vocab).float()  # [bs, ND-1, V]
    on_path = tree.ancestors[:, :, 1:].float()  # [bs, ND, ND-1]
    path_counts = torch.bmm(on_path, drafts).round().to(sampling.counts.dtype)  # [bs, ND, V]
    counts = sampling.counts[index][:, None, :] + path_counts
    prompt_mask = sampling.prompt_mask[index].repeat_interleave(nd, dim=0)
    return apply_penalties(logits, counts.view(bs * nd, vocab), prompt_mask, node_params)


def accept_tree(
    sampling: SamplingState, tree: DraftTree, logits: torch.Tensor, rows: torch.Tensor
) -> tuple[VerifyResult, torch.Tensor]:
    """Greedy or exact sampling acceptance of the tree against the verify logits [bs*ND, V].

    Returns the result and per-node log-scores whose log-softmax is the distribution each
    emitted token was drawn from (for logprobs)."""
    nd = tree.num_draft_tokens
    params = sampling.gather(rows.cpu())
    node_params = params.repeat_interleave(nd)
    logits = logits.float()
    if node_params.use_penalty:
        logits = penalize_tree(sampling, tree, logits, rows, node_params)
    if not params.use_sampling:
        return verify_greedy(tree, logits.argmax(dim=-1)), logits
    probs = processed_probs(logits, node_params)  # [bs*ND, V]
    root_positions = tree.positions.view(-1, nd)[:, 0]  # [bs]
    coins = uniform_noise(params.seed, root_positions, STREAM_SPEC_COIN, nd)
    final = uniform_noise(params.seed, root_positions, STREAM_SPEC_BONUS, 1)[:, 0]
    return verify_sampling(tree, probs, coins, final), torch.log(probs.clamp_min(1e-30))
