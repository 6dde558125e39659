from __future__ import annotations

import torch

from gpu_worker.speculative.compaction import compact_rows, compaction_moves
from gpu_worker.speculative.verify import VerifyResult, verify_greedy
from tests.gpu_worker.speculative.trees import greedy_target_for_paths, path_to, random_tree


def apply_moves(kv: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """What the KV pool does: one gather, then one scatter."""
    out = kv.clone()
    out[dst] = kv[src]
    return out


def check_moved(before, after, table, pool_idx, committed_lens, accept_index, accept_lens, nd):
    moved_dst = set()
    for b, seq in enumerate(committed_lens):
        row = table[pool_idx[b]]
        for j in range(accept_lens[b]):
            node = accept_index[b][j] - b * nd
            assert torch.equal(after[row[seq + j]], before[row[seq + node]])
            moved_dst.add(int(row[seq + j]))
    untouched = [s for s in range(1, before.shape[0]) if s not in moved_dst]
    assert torch.equal(after[untouched], before[untouched])


def paged_table(num_rows: int, width: int, page_size: int, seed: int) -> torch.Tensor:
    """Rows of whole shuffled pages (slot = page*page_size + offset); page 0 never used."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = width // page_size
    pages = torch.randperm(num_rows * pages_per_row, generator=gen) + 1
    offsets = torch.arange(page_size)
    slots = (pages.view(num_rows, pages_per_row, 1) * page_size + offsets).view(num_rows, width)
    return slots.to(torch.int32)


def test_move_accepted_kv_sizes():
    nd, steps = 6, 3
    result = VerifyResult(
        predict=torch.zeros(2 * nd, dtype=torch.int64),
        accept_index=torch.tensor([[0, 2, 5, -1], [6, 7, 9, -1]]),  # paths [0,2,5] and [0,1,3]
        accept_lens=torch.tensor([3, 3]),
    )
    committed_lens = [5, 9]
    pool_idx = [2, 1]
    table = paged_table(3, 16, 1, seed=0)
    dst, src = compaction_moves(
        result, torch.tensor(committed_lens), table, torch.tensor(pool_idx), nd, steps
    )
    assert dst.shape == src.shape == (2 * (steps + 1),)
    assert dst.dtype == src.dtype == torch.int64
    assert dst[3] == src[3] == 0 and dst[7] == src[7] == 0  # zero-filled tails
    kv = torch.randn(int(table.max()) + 1, 2, 3)
    kv[0] = 0.0
    after = apply_moves(kv, dst, src)
    check_moved(
        kv, after, table, pool_idx, committed_lens, result.accept_index.tolist(), [3, 3], nd
    )


def test_compaction_several_requests():
    bs, topk, steps, nd, vocab, page = 4, 3, 4, 10, 40, 4
    committed_lens = [3, 8, 5, 13]
    tree = random_tree(
        bs, topk, steps, nd, vocab=vocab, seed=11, committed_lens=committed_lens, sharpness=3.0
    )
    targets = [0, int(tree.depth[1].argmax()), int(tree.depth[2].argmax()), nd - 1]
    paths = [path_to(tree, b, node) for b, node in enumerate(targets)]
    assert len({len(p) for p in paths}) >= 3
    result = verify_greedy(
        tree, greedy_target_for_paths(tree, paths, [vocab + b for b in range(bs)])
    )
    assert result.accept_lens.tolist() == [len(p) for p in paths]

    table = paged_table(6, 32, page, seed=1)
    pool_idx = [4, 1, 5, 2]
    dst, src = compaction_moves(
        result, torch.tensor(committed_lens), table, torch.tensor(pool_idx), nd, steps
    )
    width = steps + 1
    assert dst.shape == (bs * width,)
    for b, path in enumerate(paths):
        assert dst[b * width + len(path) : (b + 1) * width].eq(0).all()
        assert src[b * width + len(path) : (b + 1) * width].eq(0).all()
    kv = torch.randn(int(table.max()) + 1, 5)
    kv[0] = 0.0
    after = apply_moves(kv, dst, src)
    check_moved(
        kv,
        after,
        table,
        pool_idx,
        committed_lens,
        result.accept_index.tolist(),
        result.accept_lens.tolist(),
        nd,
    )

    hidden = torch.randn(bs * nd, 7)  # verify hidden per node
    rows = compact_rows(hidden, result)
    assert rows.shape == (bs * width, 7)
    for b, path in enumerate(paths):
        for j in range(width):
            if j < len(path):
                assert torch.equal(rows[b * width + j], hidden[b * nd + path[j]])
            else:
                assert rows[b * width + j].eq(0).all()
    predict = compact_rows(result.predict, result).view(bs, width)
    tokens = tree.tokens.view(bs, nd)
    for b, path in enumerate(paths):
        assert predict[b, : len(path)].tolist() == [int(tokens[b, k]) for k in path[1:]] + [
            vocab + b
        ]
