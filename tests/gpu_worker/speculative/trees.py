"""Test helpers: random draft trees and greedy targets that accept a chosen path.

The helpers derive what they need (parents, paths) with plain Python loops over the tree's
lists, independently of the vectorised code under test.
"""

from __future__ import annotations

import torch

from gpu_worker.speculative.tree import (
    DraftRecord,
    DraftTree,
    build_tree,
    organize_draft,
    select_first_level,
    select_next_level,
)

# A tree's tensors, as `DraftTree` (and an accept stage's inputs) name them.
TREE_FIELDS = (
    "tokens",
    "positions",
    "custom_mask",
    "retrieve_index",
    "next_token",
    "next_sibling",
    "depth",
    "ancestors",
)


def draft_topk(
    num_rows: int, topk: int, vocab: int, gen: torch.Generator, sharpness: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fake draft's topk over a random distribution: (topk_p, topk_index), each [rows, topk]."""
    logits = torch.randn(num_rows, vocab, generator=gen) * sharpness
    return torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)


def run_draft_loop(
    bs: int, topk: int, num_steps: int, vocab: int, seed: int, sharpness: float = 1.0
) -> DraftRecord:
    """Run the draft-loop bookkeeping with a fake draft (random topk per row, hidden = ids)."""
    gen = torch.Generator().manual_seed(seed)
    record = DraftRecord()
    topk_p, topk_index = draft_topk(bs, topk, vocab, gen, sharpness)
    hidden = torch.zeros(bs, 2)
    _, hidden, scores = select_first_level(topk_p, topk_index, hidden, record)
    for step in range(1, num_steps):
        topk_p, topk_index = draft_topk(bs * topk, topk, vocab, gen, sharpness)
        _, hidden, scores = select_next_level(scores, topk_p, topk_index, hidden, step, record)
    return record


def random_tree(
    bs: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    vocab: int = 50,
    seed: int = 0,
    committed_lens: list[int] | None = None,
    sharpness: float = 1.0,
) -> DraftTree:
    """A tree built through the real draft bookkeeping from a fake draft."""
    record = run_draft_loop(bs, topk, num_steps, vocab, seed, sharpness)
    top, draft_tokens, parent_list = organize_draft(record, num_draft_tokens, topk, num_steps)
    seq = torch.tensor(committed_lens if committed_lens is not None else [3 + b for b in range(bs)])
    bonus = torch.arange(bs) + vocab  # never a draft token
    return build_tree(bonus, parent_list, top, draft_tokens, seq, topk, num_steps, num_draft_tokens)


def parents_of(tree: DraftTree, b: int) -> list[int]:
    """Parent local node of every node of request b (-1 for the root), from the child lists."""
    next_token, next_sibling = tree.next_token[b].tolist(), tree.next_sibling[b].tolist()
    parents = [-1] * tree.num_draft_tokens
    for p in range(tree.num_draft_tokens):
        child = next_token[p]
        while child != -1:
            parents[child] = p
            child = next_sibling[child]
    return parents


def path_to(tree: DraftTree, b: int, node: int) -> list[int]:
    """Local node ids from the root to `node` of request b."""
    parents = parents_of(tree, b)
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


def greedy_target_for_paths(
    tree: DraftTree, paths: list[list[int]], bonus: list[int]
) -> torch.Tensor:
    """A target argmax [bs*ND] under which greedy verify accepts exactly `paths[b]` then `bonus[b]`.

    Off-path nodes predict -1 (no token); bonus ids must not be tokens of the last node's children.
    """
    nd = tree.num_draft_tokens
    tokens = tree.tokens.tolist()
    target = [-1] * len(tokens)
    for b, path in enumerate(paths):
        for here, there in zip(path[:-1], path[1:], strict=True):
            target[b * nd + here] = tokens[b * nd + there]
        target[b * nd + path[-1]] = bonus[b]
    return torch.tensor(target)
