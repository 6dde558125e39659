"""The typed buffers the speculative stages hand one another, one dataclass a stage boundary.

Fields are tensors per request in batch order (S draft steps, ND tree nodes, V vocabulary, F
feature width); in a `StageGraph` each is a static buffer [max_bs, *shape] given by the specs.
Not frozen: every replay builds one, and a frozen dataclass is much slower to build.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gpu_worker.graphs.stage_graph import PER_REQUEST, StageInput
from gpu_worker.speculative.tree import DraftShape, DraftTree


@dataclass
class ProposeInputs:
    """The propose stage's input: request rows [bs]; it reads their lengths and last tokens
    from `RowState`."""

    rows: torch.Tensor


@dataclass
class Accepted:
    """What acceptance hands the draft extend (and the caller): accept_lens [bs] (accepted
    drafts + 1); tokens [bs, S+1] (the accepted drafts, then the bonus); features
    [bs*(S+1), F], the target feature of each node along the path; logprobs [bs, S+1]
    float32 of the tokens, from an accept stage (None from greedy acceptance, and where the
    extend stage's buffers are given to write into)."""

    accept_lens: torch.Tensor
    tokens: torch.Tensor
    features: torch.Tensor
    logprobs: torch.Tensor | None = None


@dataclass
class ExtendInputs:
    """The draft extend's inputs: rows, committed_lens [bs] (before this iteration), then what
    acceptance made (`Accepted`: accept_lens [bs], tokens [bs, S+1], features [bs*(S+1), F])."""

    rows: torch.Tensor
    committed_lens: torch.Tensor
    accept_lens: torch.Tensor
    tokens: torch.Tensor
    features: torch.Tensor

    def accepted(self) -> Accepted:
        """The fields acceptance writes (e.g. into the extend stage's static buffers)."""
        return Accepted(self.accept_lens, self.tokens, self.features)


def extend_specs(width: int, feature_width: int, dtype: torch.dtype) -> dict[str, StageInput]:
    """`ExtendInputs` in a stage graph (width: S+1)."""
    return {
        "rows": PER_REQUEST,
        "committed_lens": PER_REQUEST,
        "accept_lens": StageInput(pad=1),
        "tokens": StageInput((width,)),
        "features": StageInput((width, feature_width), dtype),
    }


@dataclass
class AcceptInputs:
    """What an accept stage reads: the rows, their committed lengths [bs], the tree (`DraftTree`'s
    tensors), and the verify logits [bs*ND, V] float32 and target features [bs*ND, F] of every
    node. In a stage graph each field is per request ([bs, ND, ...])."""

    rows: torch.Tensor
    committed_lens: torch.Tensor
    # the tree: `DraftTree`'s tensors (`TREE_FIELDS`)
    tokens: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    retrieve_index: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor

    def tree(self, shape: DraftShape) -> DraftTree:
        """The tree, its tokens and positions flat ([bs*ND]) as `DraftTree` keeps them."""
        nodes = self.rows.shape[0] * shape.num_draft_tokens
        tensors = {name: getattr(self, name) for name in TREE_FIELDS}
        tensors["tokens"] = self.tokens.reshape(nodes)
        tensors["positions"] = self.positions.reshape(nodes)
        return DraftTree(
            **tensors,
            topk=shape.topk,
            num_steps=shape.num_steps,
            num_draft_tokens=shape.num_draft_tokens,
        )


# The fields `AcceptInputs` (and so `Proposal`) shares with `DraftTree`: the tree's tensors,
# named once, in `AcceptInputs`. Per request two are [ND, ND] bool masks, the rest [ND] int64.
_DRAFT_TREE_FIELDS = {f.name for f in dataclasses.fields(DraftTree)}
TREE_FIELDS = tuple(
    f.name for f in dataclasses.fields(AcceptInputs) if f.name in _DRAFT_TREE_FIELDS
)
TREE_MASKS = ("custom_mask", "ancestors")


def tree_fields(tree: DraftTree) -> dict[str, torch.Tensor]:
    """The tree's tensors by field, as `AcceptInputs` and `Proposal` take them."""
    return {name: getattr(tree, name) for name in TREE_FIELDS}


def accept_specs(
    nd: int, vocab_size: int, feature_width: int, dtype: torch.dtype
) -> dict[str, StageInput]:
    """`AcceptInputs` in a stage graph."""
    node, mask = StageInput((nd,)), StageInput((nd, nd), torch.bool)
    return {
        "rows": PER_REQUEST,
        "committed_lens": PER_REQUEST,
        **{name: mask if name in TREE_MASKS else node for name in TREE_FIELDS},
        "logits": StageInput((nd, vocab_size), torch.float32),
        "features": StageInput((nd, feature_width), dtype),
    }


@dataclass
class GreedyProposal:
    """The propose stage's outputs for a plain greedy batch: the rows, their committed lengths
    [bs], and the batch accepted greedily (the extend stage's inputs); for a tree (topk > 1,
    else None) also the draws at every node [bs*ND] and the accepted path's nodes [bs, S+1],
    which `compact` reads."""

    rows: torch.Tensor
    committed_lens: torch.Tensor
    greedy_accept_lens: torch.Tensor
    greedy_tokens: torch.Tensor
    greedy_features: torch.Tensor
    greedy_predict: torch.Tensor | None
    greedy_accept_index: torch.Tensor | None


@dataclass(kw_only=True)
class Proposal(AcceptInputs):
    """The propose stage's outputs for a batch that runs an accept stage next: what the accept
    stage reads (a `Proposal` is its `AcceptInputs`), and the greedy outputs too (one
    function, captured twice: `GreedyProposal`'s fields, which the accept stage overwrites)."""

    greedy_accept_lens: torch.Tensor
    greedy_tokens: torch.Tensor
    greedy_features: torch.Tensor
    greedy_predict: torch.Tensor | None
    greedy_accept_index: torch.Tensor | None
