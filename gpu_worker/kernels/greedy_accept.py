"""Greedy acceptance of a batch of draft trees in one launch: the accepted path, the tokens it
emits and the features along it (what `verify_greedy`, `accepted_tokens` and `compact_rows`
compute in many small kernels). One program per request walks its tree level by level and
takes the first child (`next_token`, then `next_sibling`) whose token is the target's argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2

if TYPE_CHECKING:
    from gpu_worker.speculative.stage_buffers import Accepted

BLOCK_F = 512  # feature elements copied per loop iteration


def greedy_accept_reference(
    tree, target_predict: torch.Tensor, features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (predict [bs*ND], accept_index [bs, S+1], accept_lens [bs], tokens [bs, S+1],
    features along the path [bs*(S+1), F]), as `greedy_accept` returns them."""
    from gpu_worker.speculative.compaction import compact_rows
    from gpu_worker.speculative.verify import accepted_tokens, verify_greedy

    result = verify_greedy(tree, target_predict)
    return (
        result.predict,
        result.accept_index,
        result.accept_lens,
        accepted_tokens(result),
        compact_rows(features, result),
    )


@triton.jit
def _greedy_accept_kernel(
    tokens_ptr,
    target_ptr,
    next_token_ptr,
    next_sibling_ptr,
    kids_stride,
    siblings_stride,
    features_ptr,
    feature_stride,
    feature_width,
    predict_ptr,
    accept_index_ptr,
    accept_lens_ptr,
    emitted_ptr,
    out_features_ptr,
    out_feature_stride,
    ND: tl.constexpr,
    ND_P2: tl.constexpr,
    STEPS: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    base = b * ND  # the request's first node, global id
    width = STEPS + 1
    next_token_ptr += b * kids_stride  # (a chain's child lists are one row, broadcast)
    next_sibling_ptr += b * siblings_stride
    nodes = tl.arange(0, ND_P2)
    steps = tl.arange(0, WIDTH_P2)
    feats = tl.arange(0, BLOCK_F)
    predict = tl.zeros([ND_P2], dtype=tl.int64)
    path = tl.where(steps == 0, base, -1).to(tl.int64)  # global node ids along the path
    emitted = tl.zeros([WIDTH_P2], dtype=tl.int64)
    out_row = out_features_ptr + b * width * out_feature_stride
    for f in range(0, feature_width, BLOCK_F):  # the root's features lead the path's
        mask = f + feats < feature_width
        value = tl.load(features_ptr + base * feature_stride + f + feats, mask=mask)
        tl.store(out_row + f + feats, value, mask=mask)
    last = tl.zeros([], dtype=tl.int64)  # the current node, local id
    active = tl.full([], 1, dtype=tl.int1)
    count = tl.zeros([], dtype=tl.int64)  # accepted drafts
    for level in tl.static_range(STEPS):
        want = tl.load(target_ptr + base + last)
        kid = tl.load(next_token_ptr + last)
        chosen = tl.full([], -1, dtype=tl.int64)
        for _ in tl.static_range(TOPK):  # a node has at most topk children
            valid = kid >= 0
            safe = tl.maximum(kid, 0)
            token = tl.load(tokens_ptr + base + safe)
            chosen = tl.where(valid & (chosen < 0) & (token == want), kid, chosen)
            kid = tl.where(valid, tl.load(next_sibling_ptr + safe), -1)
        accepted = active & (chosen >= 0)
        predict = tl.where(accepted & (nodes == last), want, predict)
        emitted = tl.where(accepted & (steps == level), want, emitted)
        path = tl.where(accepted & (steps == level + 1), base + chosen, path)
        source = base + tl.maximum(chosen, 0)
        row = out_row + (level + 1) * out_feature_stride
        for f in range(0, feature_width, BLOCK_F):  # the accepted child's features, or zeros
            mask = f + feats < feature_width
            value = tl.load(
                features_ptr + source * feature_stride + f + feats, mask=mask & accepted, other=0.0
            )
            tl.store(row + f + feats, value, mask=mask)
        last = tl.where(accepted, chosen, last)
        count += accepted.to(tl.int64)
        active = accepted
    bonus = tl.load(target_ptr + base + last)
    predict = tl.where(nodes == last, bonus, predict)
    emitted = tl.where(steps == count, bonus, emitted)
    tl.store(predict_ptr + base + nodes, predict, mask=nodes < ND)
    tl.store(accept_index_ptr + b * width + steps, path, mask=steps < width)
    tl.store(emitted_ptr + b * width + steps, emitted, mask=steps < width)
    tl.store(accept_lens_ptr + b, count + 1)


def greedy_accept(
    tree,
    target_predict: torch.Tensor,
    features: torch.Tensor,
    out: Accepted | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_accept_reference` in one launch. tree: a `DraftTree` (its next_token and
    next_sibling rows may be one row broadcast); target_predict [bs*ND]
    int64, the target's argmax at every node; features [bs*ND, F] (rows contiguous).
    out: where to write accept_lens [bs], tokens [bs, S+1] and features [bs, S+1, F] (e.g.
    the next stage's input buffers; its logprobs unused; all made here when None)."""
    bs, nd = tree.next_token.shape
    width, feature_width = tree.num_steps + 1, features.shape[1]
    assert features.stride(1) == 1 and target_predict.dtype == torch.int64
    device = features.device
    predict = torch.empty(bs * nd, dtype=torch.int64, device=device)
    accept_index = torch.empty(bs, width, dtype=torch.int64, device=device)
    if out is not None:
        accept_lens, emitted, path_features = out.accept_lens, out.tokens, out.features
    else:
        accept_lens = torch.empty(bs, dtype=torch.int64, device=device)
        emitted = torch.empty(bs, width, dtype=torch.int64, device=device)
        path_features = features.new_empty(bs, width, feature_width)
    assert path_features.is_contiguous() and emitted.is_contiguous()
    kids, siblings = tree.next_token, tree.next_sibling
    assert kids.stride(1) == 1 and siblings.stride(1) == 1 and tree.tokens.is_contiguous()
    _greedy_accept_kernel[(bs,)](
        tree.tokens,
        target_predict,
        kids,
        siblings,
        kids.stride(0),
        siblings.stride(0),
        features,
        features.stride(0),
        feature_width,
        predict,
        accept_index,
        accept_lens,
        emitted,
        path_features,
        path_features.stride(1),
        ND=nd,
        ND_P2=next_power_of_2(nd),
        STEPS=tree.num_steps,
        WIDTH_P2=next_power_of_2(width),
        TOPK=tree.topk,
        BLOCK_F=BLOCK_F,
    )
    return predict, accept_index, accept_lens, emitted, path_features.view(bs * width, -1)
