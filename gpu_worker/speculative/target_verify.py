"""The target side of a speculative step, shared by every draft algorithm: one TARGET_VERIFY
forward over all tree nodes (`verify_tree`) and acceptance (`accept_tree`: greedy, or exact
speculative sampling of the processed target distribution, seeded by the request's seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.forward_batch import ForwardMode, make_batch
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
from gpu_worker.speculative.compaction import compact_rows
from gpu_worker.speculative.tree import DraftTree
from gpu_worker.speculative.verify import (
    VerifyResult,
    accepted_tokens,
    verify_greedy,
    verify_sampling,
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


@dataclass(frozen=True)
class SpecStepOutput:
    """One decode iteration's result, per request in batch order."""

    tokens: torch.Tensor  # [bs, S+1] accepted drafts then the bonus, valid up to accept_lens
    accept_lens: torch.Tensor  # [bs] int64, tokens emitted (accepted drafts + 1)
    logprobs: torch.Tensor | None  # [bs, S+1] float32, or None


def verify_and_accept(
    target: ModelRunner,
    sampling: SamplingState,
    tree: DraftTree,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_cpu: list[int],
    want_logprobs: bool,
) -> tuple[VerifyResult, LogitsOutput, SpecStepOutput]:
    """The target side of one iteration, for every draft algorithm: verify the trees, accept,
    and read off the emitted tokens (and their logprobs)."""
    verify_out = verify_tree(target, tree, rows, seq_lens, seq_cpu)
    result, scores = accept_tree(sampling, tree, verify_out.next_token_logits, rows)
    tokens = accepted_tokens(result)  # [bs, S+1]
    logprobs = None
    if want_logprobs:
        node_scores = compact_rows(torch.log_softmax(scores, dim=-1), result)
        logprobs = node_scores.gather(1, tokens.view(-1, 1)).view_as(tokens).float()
    return result, verify_out, SpecStepOutput(tokens, result.accept_lens, logprobs)


def accepted_rows(x: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """x [bs*ND, ...] -> the rows of each request's accepted nodes in path order, request by
    request: [sum(accept_lens), ...]."""
    width = result.accept_index.shape[1]
    valid = torch.arange(width, device=x.device)[None, :] < result.accept_lens[:, None]
    return compact_rows(x, result)[valid.flatten()]


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
