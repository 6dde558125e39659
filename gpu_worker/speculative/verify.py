"""Target verification of a draft tree: greedy acceptance and exact speculative sampling.

Both walk each request's tree from the root one level at a time (S levels, vectorised over
the batch), visiting the current node's children in list order (`next_token`, then
`next_sibling`). Greedy accepts the first child whose token equals the target's argmax at the
current node. Sampling accepts child c when the coin of the current node is
<= the target probability mass of the children tried so far, c included (thresholds
1.0); when no child is accepted the next token is drawn from the target
distribution with the rejected children's tokens removed (renormalised), which makes every
emitted token an exact sample of the target.

`predict[b*ND + k]` is the token that follows accepted node k (the next accepted draft, or the
bonus for the last one); other entries stay 0. `accept_index` lists the accepted nodes' global
ids `b*ND + k` along the path, -1 padded, with stride `S+1` per request (never ND).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker import constants
from gpu_worker.speculative.tree import DraftTree

# (last [bs] current node, kid_tokens [bs, topk], valid [bs, topk]) -> accept [bs, topk] bool
AcceptChild = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def walk_accepted_path(
    tree: DraftTree, accept_child: AcceptChild
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow the first accepted child level by level.

    -> (accept_local [bs, S+1] local node ids, -1 padded; last [bs] last accepted node;
    last_kids [bs, topk] children of `last`, -1 padded, all of them rejected or none).
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
        hit = accept_child(last, kid_tokens, valid) & valid & active[:, None]
        first = torch.where(hit, order, topk).amin(dim=1)  # [bs]
        accepted = first < topk
        chosen = kids.gather(1, first.clamp(max=topk - 1)[:, None]).squeeze(1)
        path.append(torch.where(accepted, chosen, -1))
        last = torch.where(accepted, chosen, last)
        active = accepted
    kids = all_kids.gather(1, last[:, None, None].expand(bs, 1, topk)).squeeze(1)
    return torch.stack(path, dim=1), last, kids


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

    def accept_child(last, kid_tokens, valid):
        return kid_tokens == target.gather(1, last[:, None])

    accept_local, last, _ = walk_accepted_path(tree, accept_child)
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


def first_occurrence(kid_tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[bs, topk] bool: a valid child whose token no earlier valid sibling carries."""
    topk = kid_tokens.shape[1]
    same = kid_tokens[:, :, None] == kid_tokens[:, None, :]  # [bs, r, r']
    earlier = torch.ones(topk, topk, device=valid.device, dtype=torch.bool).tril(-1)
    dup = (same & earlier & valid[:, None, :]).any(dim=2)
    return valid & ~dup


def verify_sampling(
    tree: DraftTree,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> VerifyResult:
    """Sample the accepted path so every emitted token follows the target exactly.

    target_probs [bs*ND, V] float32: processed target distribution at each node (one-hot rows
    for greedy requests, which then reproduce `verify_greedy`); coins [bs, ND] uniform in
    (0, 1), one per node (used while that node is the current one); final_coins [bs] uniform
    in (0, 1) for the token after the last accepted node. No host sync.
    """
    bs, nd = tree.next_token.shape
    probs = target_probs.view(bs, nd, -1)  # [bs, ND, V]
    if tree.topk == 1 and nd == tree.num_steps + 1:
        return verify_sampling_chain(tree, probs, coins, final_coins)
    return verify_sampling_walk(tree, probs, coins, final_coins)


def verify_sampling_walk(
    tree: DraftTree, probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor
) -> VerifyResult:
    """`verify_sampling` for any tree, one level at a time. probs [bs, ND, V]."""
    bs, nd = tree.next_token.shape
    rows = torch.arange(bs, device=probs.device)

    def accept_child(last, kid_tokens, valid):
        q = probs[rows, last]  # [bs, V]
        q_kid = q.gather(1, kid_tokens) * first_occurrence(kid_tokens, valid)  # [bs, topk]
        coin = coins.gather(1, last[:, None])  # [bs, 1]
        return (coin <= q_kid.cumsum(dim=1)) & (q_kid > 0)

    accept_local, last, last_kids = walk_accepted_path(tree, accept_child)
    q_last = probs[rows, last]  # [bs, V]
    valid = last_kids >= 0
    kid_tokens = torch.where(valid, tree.tokens.view(bs, nd).gather(1, last_kids.clamp(min=0)), 0)
    final = sample_residual(q_last, kid_tokens, valid, final_coins)
    return assemble_result(tree, accept_local, final)


def verify_sampling_chain(
    tree: DraftTree, probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor
) -> VerifyResult:
    """`verify_sampling` for a chain (node k's only child is k+1): draft k+1 is accepted when
    node k's coin is at most the target's probability of it there (and that is above 0), so
    the accepted drafts are the longest run of such levels, found at once rather than walked.
    The token after the run is sampled from the last accepted node's distribution without the
    rejected draft. probs [bs, ND, V]."""
    bs, nd = tree.next_token.shape
    tokens = tree.tokens.view(bs, nd).to(torch.int64)
    q_next = probs[:, :-1].gather(2, tokens[:, 1:, None]).squeeze(2)  # [bs, S]
    hit = (coins[:, :-1] <= q_next) & (q_next > 0)
    num_correct = hit.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [bs]
    node = constants.arange(nd, probs.device)[None, :]
    accept_local = torch.where(node <= num_correct[:, None], node, -1)  # [bs, S+1]
    vocab = probs.shape[2]
    q_last = probs.gather(1, num_correct[:, None, None].expand(bs, 1, vocab)).squeeze(1)
    rejected = tokens.gather(1, (num_correct + 1).clamp(max=nd - 1)[:, None])  # [bs, 1]
    final = sample_residual(q_last, rejected, (num_correct < nd - 1)[:, None], final_coins)
    return assemble_result(tree, accept_local, final)


def sample_residual(
    q: torch.Tensor, rejected_tokens: torch.Tensor, valid: torch.Tensor, final_coins: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sample of q [bs, V] with the rejected tokens [bs, topk] removed -> [bs] int64.

    Falls back to argmax(q) if nothing is left (numerically impossible for exact inputs).
    """
    rejected = torch.zeros_like(q).scatter_add_(1, rejected_tokens, valid.to(q.dtype))
    residual = torch.where(rejected > 0, 0.0, q)  # relu(q - p_rejected)
    cdf = residual.cumsum(dim=1)  # [bs, V]
    total = cdf[:, -1:]
    u = final_coins.to(cdf.dtype)[:, None] * total
    token = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=q.shape[1] - 1)
    return torch.where(total.squeeze(1) > 0, token, q.argmax(dim=1))


def accepted_tokens(result: VerifyResult) -> torch.Tensor:
    """Tokens emitted along each accepted path: [bs, S+1] int64 = predict[accept_index], 0 at -1."""
    tokens = result.predict[result.accept_index.clamp(min=0)]
    return torch.where(result.accept_index >= 0, tokens, 0)
