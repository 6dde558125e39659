"""Draft-loop bookkeeping and draft-tree construction.

The draft loop runs S levels over bs*topk rows (`row = b*topk + j`), recording each level's
candidates in a `DraftRecord`; `organize_draft` keeps the ND-1 best (ids sorted, so the set is
ancestor-closed) and `build_tree` makes the `DraftTree` (node 0 the root, the bonus token). A
chain (topk 1, ND = S+1) is built from constants (`chain_tree`). Functions are pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_worker import constants


@dataclass
class DraftRecord:
    """What each draft level recorded (one entry per level, in level order). Score-space ids
    per request: level 0 has 0..topk-1, level i >= 1 `topk + (i-1)*topk^2 + r*topk + c`
    (r: the expanded row, c: the child).

    scores[i]: [bs, 1, topk] (level 0) or [bs, topk, topk] (level i >= 1) path scores.
    tokens[i]: [bs, topk] (level 0) or [bs, topk*topk] candidate token ids (int64).
    parents[i]: [bs, topk+1] (level 0: [-1, 0..topk-1]) or [bs, topk] score ids of the rows
        expanded at the next level.
    """

    scores: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)
    parents: list[torch.Tensor] = field(default_factory=list)


def select_first_level(
    topk_p: torch.Tensor, topk_index: torch.Tensor, hidden: torch.Tensor, record: DraftRecord
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Level 0: every request's topk first drafts become its topk rows. Appends to `record`.

    topk_p [bs, topk] float, topk_index [bs, topk] int64, hidden [bs, H] ->
    (input_ids [bs*topk], hidden [bs*topk, H], path_scores [bs, topk]).
    """
    bs, topk = topk_p.shape
    parents = constants.cached(
        ("first_level_parents", topk),
        topk_p.device,
        lambda: torch.arange(-1, topk, device=topk_p.device),
    )  # [topk+1]
    record.scores.append(topk_p.unsqueeze(1))  # [bs, 1, topk]
    record.tokens.append(topk_index)
    record.parents.append(parents.expand(bs, topk + 1))
    rows = hidden if topk == 1 else hidden.repeat_interleave(topk, dim=0)
    return topk_index.flatten(), rows, topk_p


def select_next_level(
    path_scores: torch.Tensor,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden: torch.Tensor,
    step: int,
    record: DraftRecord,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Level `step` >= 1: keep each request's topk best of its topk^2 children; appends to `record`.

    path_scores [bs, topk] (path probability of each row), topk_p / topk_index [bs*topk, topk]
    (the draft's topk after each row's forward), hidden [bs*topk, H] (the draft's output) ->
    (input_ids [bs*topk], hidden [bs*topk, H] of each chosen child's parent row, path_scores
    [bs, topk]). Parent rows are gathered with the per-request offset `c//topk + b*topk`.
    """
    bs, topk = path_scores.shape
    expand = path_scores[:, :, None] * topk_p.view(bs, topk, topk)  # [bs, topk, topk]
    if topk == 1:  # a chain: each row's one child, on the same row
        record.scores.append(expand)
        record.tokens.append(topk_index)
        parent = constants.full(1, step, topk_index.device)  # = the general formula's
        record.parents.append(parent.expand(bs, 1))
        return topk_index.flatten(), hidden, expand.view(bs, 1)
    new_scores, choice = torch.topk(expand.flatten(1), topk, dim=1)  # [bs, topk]
    tokens = topk_index.view(bs, topk * topk)  # [bs, topk*topk]
    input_ids = tokens.gather(1, choice).flatten()  # [bs*topk]
    offsets = constants.arange(bs, choice.device)[:, None] * topk
    parent_rows = (choice // topk + offsets).flatten()  # [bs*topk]
    record.scores.append(expand)
    record.tokens.append(tokens)
    record.parents.append(choice + topk * topk * (step - 1) + topk)
    return input_ids, hidden[parent_rows], new_scores


def organize_draft(
    record: DraftRecord, num_draft_tokens: int, topk: int, num_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the ND-1 best candidates of each request.

    -> (top_scores_index [bs, ND-1] int64 sorted ascending, draft_tokens [bs, ND-1] int64,
    parent_list [bs, topk*(S-1)+1] int64 = levels 0..S-2's parents concatenated). Requires
    `ND-1 <= topk + (S-1)*topk^2`. (A chain needs none of this: see `tree_from_draft`.)
    """
    scores = torch.cat([s.flatten(1) for s in record.scores], dim=1)  # [bs, topk+(S-1)*topk^2]
    top = torch.topk(scores, num_draft_tokens - 1, dim=1).indices
    top_scores_index = torch.sort(top, dim=1).values  # [bs, ND-1]
    tokens = torch.cat(record.tokens, dim=1)  # [bs, topk+(S-1)*topk^2]
    draft_tokens = tokens.gather(1, top_scores_index)
    parent_list = torch.cat(record.parents[: max(num_steps - 1, 1)], dim=1)
    parent_list = parent_list[:, : topk * (num_steps - 1) + 1]  # S == 1: just the root's [-1]
    return top_scores_index, draft_tokens, parent_list


@dataclass(frozen=True)
class DraftShape:
    """The shape of every tree a speculative worker drafts: S levels of topk branches, ND
    nodes verified (root included)."""

    topk: int
    num_steps: int
    num_draft_tokens: int

    @property
    def is_chain(self) -> bool:
        """One branch, every draft verified: node k is draft k (`chain_tree`)."""
        return self.topk == 1 and self.num_draft_tokens == self.num_steps + 1


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees of `num_draft_tokens` (ND) nodes each, ready for verify.

    tokens [bs*ND] int64 (node 0 = bonus/root); positions [bs*ND] int64 (= prefix + depth);
    custom_mask [bs, ND, ND] bool, the tree-local verify mask over the ND node keys (row k:
    node k itself and its ancestors; the prefix before the nodes is always visible);
    retrieve_index, next_token, next_sibling [bs, ND] int64 (-1 = none; retrieve_index[b, k]
    = b*ND + k; child lists in ascending node order); depth [bs, ND] int64; ancestors
    [bs, ND, ND] bool (row k: node k itself and its ancestors, root included).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    retrieve_index: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    depth: torch.Tensor
    topk: int
    num_steps: int
    num_draft_tokens: int
    ancestors: torch.Tensor | None = None


def find_parents(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int
) -> torch.Tensor:
    """Parent node of every node: [bs, ND] int64, -1 for the root.

    Node k >= 1 has score id `top_scores_index[k-1]`; its parent slot is `id // topk`. Slot 0
    means the root; otherwise `parent_list[slot]` is the parent's score id and the parent node
    is 1 + its index in `top_scores_index`. A parent missing from the selection (an invalid
    tree from ties/NaN) falls back to the root.
    """
    bs = top_scores_index.shape[0]
    top_scores_index = top_scores_index.contiguous()
    slot = top_scores_index // topk  # [bs, ND-1]
    parent_id = parent_list.gather(1, slot.clamp(max=parent_list.shape[1] - 1))
    found_at = torch.searchsorted(top_scores_index, parent_id)  # [bs, ND-1]
    found_at = found_at.clamp(max=top_scores_index.shape[1] - 1)
    found = top_scores_index.gather(1, found_at) == parent_id
    parent = torch.where((slot > 0) & found, found_at + 1, 0)
    root = torch.full((bs, 1), -1, device=parent.device, dtype=torch.int64)
    return torch.cat([root, parent], dim=1)  # [bs, ND]


def find_ancestors(parents: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Self+ancestor matrix [bs, ND, ND] bool (row k, column a) and depth [bs, ND] int64."""
    bs, nd = parents.shape
    none = torch.full((bs, 1), nd, device=parents.device, dtype=torch.int64)
    parent_ext = torch.cat([torch.where(parents < 0, nd, parents), none], dim=1)  # [bs, ND+1]
    eye = torch.eye(nd, nd + 1, device=parents.device, dtype=torch.bool)
    ancestors = eye.expand(bs, nd, nd + 1).clone()  # [bs, ND, ND+1], column ND = "none"
    depth = torch.zeros(bs, nd, device=parents.device, dtype=torch.int64)
    cur = parent_ext[:, :nd]  # [bs, ND]
    for _ in range(num_steps):  # depth of any node <= S
        ancestors.scatter_(2, cur[:, :, None], True)
        depth += cur != nd
        cur = parent_ext.gather(1, cur)
    return ancestors[:, :, :nd], depth


def link_children(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling lists in ascending node order: two [bs, ND] int64 (-1 none)."""
    nd = parents.shape[1]
    node = torch.arange(nd, device=parents.device, dtype=torch.int64)
    is_child = parents[:, None, :] == node[None, :, None]  # [bs, parent, child]
    next_token = torch.where(is_child, node, nd).amin(dim=2)  # [bs, ND]
    later_sibling = (parents[:, :, None] == parents[:, None, :]) & (node[None, :] > node[:, None])
    next_sibling = torch.where(later_sibling, node, nd).amin(dim=2)  # [bs, ND]
    next_token = torch.where(next_token < nd, next_token, -1)
    return next_token, torch.where(next_sibling < nd, next_sibling, -1)


def build_tree(
    bonus_tokens: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    committed_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
) -> DraftTree:
    """Build the verify trees from `organize_draft`'s output.

    bonus_tokens [bs], committed_lens [bs] (committed KV length = root position), the rest as
    returned by `organize_draft`; all on one device. Fixed shapes, no host reads.
    """
    bs, nd = committed_lens.shape[0], num_draft_tokens
    device = committed_lens.device
    parents = find_parents(parent_list, top_scores_index, topk)  # [bs, ND]
    ancestors, depth = find_ancestors(parents, num_steps)
    next_token, next_sibling = link_children(parents)
    tokens = torch.cat([bonus_tokens.to(torch.int64)[:, None], draft_tokens.to(torch.int64)], 1)
    node = constants.arange(nd, device)
    retrieve_index = node[None, :] + constants.arange(bs, device)[:, None] * nd
    return DraftTree(
        tokens=tokens.flatten(),
        positions=(committed_lens.to(torch.int64)[:, None] + depth).flatten(),
        custom_mask=ancestors,
        retrieve_index=retrieve_index,
        next_token=next_token,
        next_sibling=next_sibling,
        depth=depth,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=nd,
        ancestors=ancestors,
    )


@dataclass(frozen=True)
class ChainConstants:
    """A chain's structure, the same for every request: node (its index and depth),
    next_token, next_sibling [1, ND] int64; ancestors [1, ND, ND] bool."""

    node: torch.Tensor
    ancestors: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor


def chain_constants(nd: int, device: torch.device) -> ChainConstants:
    """`ChainConstants` made once per device, so a chain tree costs no kernels to describe."""

    def make() -> ChainConstants:
        node = torch.arange(nd, device=device, dtype=torch.int64)[None, :]
        return ChainConstants(
            node=node,
            ancestors=torch.ones(nd, nd, dtype=torch.bool, device=device).tril()[None],
            next_token=torch.where(node + 1 < nd, node + 1, -1),
            next_sibling=torch.full_like(node, -1),
        )

    return constants.cached(("chain", nd), device, make)


def tree_from_draft(
    record: DraftRecord, bonus_tokens: torch.Tensor, committed_lens: torch.Tensor, shape: DraftShape
) -> DraftTree:
    """The verify trees of a finished draft loop: a chain (topk 1, ND = S+1) directly from
    its tokens, any other shape through `organize_draft` and `build_tree`."""
    topk, steps, nd = shape.topk, shape.num_steps, shape.num_draft_tokens
    if shape.is_chain:
        return chain_tree(bonus_tokens, record.tokens, committed_lens, steps)
    top_scores_index, draft_tokens, parent_list = organize_draft(record, nd, topk, steps)
    return build_tree(
        bonus_tokens, parent_list, top_scores_index, draft_tokens, committed_lens, topk, steps, nd
    )


def chain_tree(
    bonus_tokens: torch.Tensor,
    draft_tokens: torch.Tensor | list[torch.Tensor],
    committed_lens: torch.Tensor,
    num_steps: int,
) -> DraftTree:
    """topk == 1, ND == S+1: node k is draft k at depth k, every node's only child is the next
    one (draft_tokens [bs, S] int64, or S [bs, 1] columns). What `build_tree` computes for such
    a tree, from constants."""
    bs, nd = committed_lens.shape[0], num_steps + 1
    device = committed_lens.device
    c = chain_constants(nd, device)
    columns = draft_tokens if isinstance(draft_tokens, list) else [draft_tokens]
    tokens = torch.cat([bonus_tokens.to(torch.int64)[:, None], *columns], 1)  # one launch
    nodes = constants.cached(  # b * ND + k: the node's row among all the batch's nodes
        ("chain_nodes", bs, nd), device, lambda: torch.arange(bs * nd, device=device).view(bs, nd)
    )
    ancestors = c.ancestors.expand(bs, nd, nd)
    return DraftTree(
        tokens=tokens.flatten(),
        positions=(committed_lens.to(torch.int64)[:, None] + c.node).flatten(),
        custom_mask=ancestors,
        retrieve_index=nodes,
        next_token=c.next_token.expand(bs, nd),
        next_sibling=c.next_sibling.expand(bs, nd),
        depth=c.node.expand(bs, nd),
        topk=1,
        num_steps=num_steps,
        num_draft_tokens=nd,
        ancestors=ancestors,
    )
