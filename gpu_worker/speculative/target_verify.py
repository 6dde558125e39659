"""The target side of a speculative step, shared by every draft algorithm: one TARGET_VERIFY
forward over all tree nodes (`verify_tree`) and acceptance (`accept_and_read`).

Acceptance draws at every node the token plain decoding would emit there, so a seeded request
emits plain decoding's tokens whatever the draft (`docs/speculation.md`). Fixed shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker import constants
from gpu_worker.kernels.greedy_accept import greedy_accept_reference
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import (
    SamplingRows,
    SamplingState,
    apply_penalties,
    pick_logprobs,
    process_logits,
    sample_with_noise,
)
from gpu_worker.speculative.compaction import compact_rows
from gpu_worker.speculative.tree import DraftTree
from gpu_worker.speculative.verify import VerifyResult
from gpu_worker.step.forward_batch import ForwardMode, LogitsOutput, make_batch


def verify_tree(
    target: ModelRunner,
    tree: DraftTree,
    rows: torch.Tensor,
    committed_lens: torch.Tensor,
    committed_lens_cpu: list[int],
    greedy_ids: bool = False,
) -> LogitsOutput:
    """One target forward over all ND nodes of every tree; node k's KV goes to the slot of
    position prefix + k (its rotary position is prefix + depth). Fixed shapes, device lengths
    (committed_lens_cpu only feeds host-planned backends); greedy_ids: each node's argmax
    instead of its logits."""
    nd, bs = tree.num_draft_tokens, rows.shape[0]
    offsets = constants.arange(nd, committed_lens.device)
    positions = committed_lens.long()[:, None] + offsets  # [bs, ND]
    slots = target.req_to_token_pool.req_to_token[rows.long()[:, None], positions]  # [bs, ND]
    batch = make_batch(
        ForwardMode.TARGET_VERIFY,
        tree.tokens,
        tree.positions,
        slots.flatten(),
        rows,
        [s + nd for s in committed_lens_cpu],
        [nd] * bs,
        custom_mask=tree.custom_mask,
        seq_lens=committed_lens + nd,
        extend_seq_lens=constants.full(bs, nd, committed_lens.device),
        greedy_ids=greedy_ids,
    )
    return target.forward(batch)


@dataclass(frozen=True)
class SpecStepOutput:
    """One decode iteration's result, per request in batch order."""

    tokens: torch.Tensor  # [bs, S+1] accepted drafts then the bonus, valid up to accept_lens
    accept_lens: torch.Tensor  # [bs] int64, tokens emitted (accepted drafts + 1)
    logprobs: torch.Tensor | None  # [bs, S+1] float32, or None


# (tree, draws [bs*ND], features [bs*ND, F]) -> (predict, accept_index, accept_lens, tokens,
# features along the path): `kernels.greedy_accept` or its reference.
AcceptGreedy = Callable[..., tuple[torch.Tensor, ...]]


def accept_and_read(
    sampling: SamplingState,
    tree: DraftTree,
    logits: torch.Tensor,
    features: torch.Tensor,
    rows: torch.Tensor,
    flags: Sequence[bool],
    accept_greedy: AcceptGreedy = greedy_accept_reference,
) -> tuple[VerifyResult, SpecStepOutput, torch.Tensor]:
    """The target side of one iteration after the verify forward, for every draft algorithm:
    each node's draw from the verify logits [bs*ND, V] with the sampling stages `flags` (as
    `SamplingState.gather` takes them), the accepted path through `accept_greedy`, and the
    emitted tokens with their logprobs. -> (result, step, the target features [bs*ND, F]
    along the path). No host sync: what the accept stage graphs capture."""
    draws, scores = node_draws(sampling, tree, logits, rows, flags=flags)
    predict, accept_index, accept_lens, tokens, path_features = accept_greedy(tree, draws, features)
    result = VerifyResult(predict, accept_index, accept_lens)
    logprobs = pick_logprobs(compact_rows(scores, result), tokens.view(-1)).view_as(tokens)
    return result, SpecStepOutput(tokens, accept_lens, logprobs), path_features


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


def node_draws(
    sampling: SamplingState,
    tree: DraftTree,
    logits: torch.Tensor,
    rows: torch.Tensor,
    rows_cpu: np.ndarray | None = None,
    flags: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token plain decoding would emit after each node, from the verify logits [bs*ND, V]:
    (draws [bs*ND] int64, scores [bs*ND, V] whose log-softmax is the distribution each was
    drawn from, for its logprob; a greedy row's are its (penalised) logits, as in plain
    decoding). The stages that run are fixed (flags, as `SamplingState.gather` takes them:
    what the accept stages run) or follow the rows (rows_cpu, their host copy: each batch's
    own stages, the reference the fixed ones are tested against)."""
    nd = tree.num_draft_tokens
    params = sampling.gather(rows, rows_cpu, flags)
    node_params = params.repeat_interleave(nd)
    logits = logits.float()
    if node_params.use_penalty:
        logits = penalize_tree(sampling, tree, logits, rows, node_params)
    argmax = logits.argmax(dim=-1)
    if not params.use_sampling:
        return argmax, logits
    processed = process_logits(logits, node_params)  # [bs*ND, V]
    drawn = sample_with_noise(processed, node_params.seed, tree.positions + 1)
    return torch.where(node_params.greedy, argmax, drawn), processed
