"""Target verification of a draft tree: the longest path of drafts that equal the target's
token at their parent (its argmax, or a sampled request's seeded draw: `target_verify`).

`predict[b*ND + k]` is the token after accepted node k (0 elsewhere); `accept_index` lists the
accepted nodes' ids b*ND + k along the path, -1 padded, stride S+1 per request (never ND).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker import constants
from gpu_worker.speculative.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying a batch of trees (all int64, on the tree's device).

    predict [bs*ND]: token following each accepted node (0 elsewhere); accept_index [bs, S+1]:
    global node ids along the accepted path (-1 padded); accept_lens [bs]: tokens emitted this
    step (the accepted drafts, then the bonus token).
    """

    predict: torch.Tensor
    accept_index: torch.Tensor
    accept_lens: torch.Tensor

    @property
    def num_correct(self) -> torch.Tensor:
        """[bs] accepted drafts (the root excluded)."""
        return self.accept_lens - 1


def child_lists(tree: DraftTree) -> torch.Tensor:
    """Children of every node in list order: [bs, ND, topk] int64 local node ids, -1 padded.

    A node has at most `topk` children (one draft row's topk, or the first level).
    """
    kids = [tree.next_token]
    for _ in range(tree.topk - 1):
        prev = kids[-1]
        kids.append(torch.where(prev >= 0, tree.next_sibling.gather(1, prev.clamp(min=0)), -1))
    return torch.stack(kids, dim=2)


def walk_accepted_path(tree: DraftTree, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow the first child whose token is the target's [bs, ND] at its parent, level by
    level. -> (accept_local [bs, S+1] local node ids, -1 padded; last [bs] last accepted node).
    """
    nd, topk = tree.num_draft_tokens, tree.topk
    bs = tree.next_token.shape[0]
    all_kids = child_lists(tree)  # [bs, ND, topk]
    tokens = tree.tokens.view(bs, nd)
    order = torch.arange(topk, device=tokens.device, dtype=torch.int64)
    last = torch.zeros(bs, device=tokens.device, dtype=torch.int64)
    active = torch.ones(bs, device=tokens.device, dtype=torch.bool)
    path = [last]
    for _ in range(tree.num_steps):
        kids = all_kids.gather(1, last[:, None, None].expand(bs, 1, topk)).squeeze(1)
        valid = kids >= 0  # [bs, topk]
        kid_tokens = torch.where(valid, tokens.gather(1, kids.clamp(min=0)), 0)  # [bs, topk]
        hit = (kid_tokens == target.gather(1, last[:, None])) & valid & active[:, None]
        first = torch.where(hit, order, topk).amin(dim=1)  # [bs]
        accepted = first < topk
        chosen = kids.gather(1, first.clamp(max=topk - 1)[:, None]).squeeze(1)
        path.append(torch.where(accepted, chosen, -1))
        last = torch.where(accepted, chosen, last)
        active = accepted
    return torch.stack(path, dim=1), last


def assemble_result(
    tree: DraftTree, accept_local: torch.Tensor, final_tokens: torch.Tensor
) -> VerifyResult:
    """Write predict/accept_index from the accepted path and the token after its last node."""
    nd = tree.num_draft_tokens
    bs = accept_local.shape[0]
    device = accept_local.device
    accepted = accept_local >= 0  # [bs, S+1]
    num_correct = accepted[:, 1:].sum(dim=1)  # [bs]
    tokens = tree.tokens.view(bs, nd)
    follow = tokens.gather(1, accept_local[:, 1:].clamp(min=0))  # [bs, S]
    follow = torch.cat([follow, torch.zeros_like(follow[:, :1])], dim=1)  # [bs, S+1]
    follow.scatter_(1, num_correct[:, None], final_tokens.to(torch.int64)[:, None])
    base = constants.arange(bs, device)[:, None] * nd
    accept_index = torch.where(accepted, accept_local + base, -1)
    predict = torch.zeros(bs * nd + 1, device=device, dtype=torch.int64)  # last = dummy sink
    predict.scatter_(0, torch.where(accepted, accept_index, bs * nd).flatten(), follow.flatten())
    return VerifyResult(predict[: bs * nd], accept_index, num_correct + 1)


def verify_greedy(tree: DraftTree, target_predict: torch.Tensor) -> VerifyResult:
    """Accept the longest path whose drafts equal the target's argmax.

    target_predict [bs*ND] int: the target's argmax at every node. No host sync.
    """
    bs, nd = tree.next_token.shape
    target = target_predict.to(torch.int64).view(bs, nd)
    if tree.topk == 1 and nd == tree.num_steps + 1:
        return verify_greedy_chain(tree, target)
    return verify_greedy_walk(tree, target)


def verify_greedy_walk(tree: DraftTree, target: torch.Tensor) -> VerifyResult:
    """`verify_greedy` for any tree, one level at a time. target [bs, ND]: argmax per node."""
    accept_local, last = walk_accepted_path(tree, target)
    final = target.gather(1, last[:, None]).squeeze(1)
    return assemble_result(tree, accept_local, final)


def verify_greedy_chain(tree: DraftTree, target: torch.Tensor) -> VerifyResult:
    """`verify_greedy` for a chain (node k's only child is k+1): the accepted drafts are the
    longest prefix of drafts equal to the target's argmax at their parent. target [bs, ND]."""
    bs, nd = target.shape
    tokens = tree.tokens.view(bs, nd)
    match = (tokens[:, 1:] == target[:, :-1]).to(torch.int64)  # [bs, S]
    num_correct = match.cumprod(dim=1).sum(dim=1)  # [bs]
    node = constants.arange(nd, target.device)[None, :]
    accept_local = torch.where(node <= num_correct[:, None], node, -1)  # [bs, S+1]
    final = target.gather(1, num_correct[:, None]).squeeze(1)
    return assemble_result(tree, accept_local, final)


def accepted_tokens(result: VerifyResult) -> torch.Tensor:
    """Tokens emitted along each accepted path: [bs, S+1] int64 = predict[accept_index], 0 at -1."""
    tokens = result.predict[result.accept_index.clamp(min=0)]
    return torch.where(result.accept_index >= 0, tokens, 0)
