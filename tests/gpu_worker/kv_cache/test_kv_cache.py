from __future__ import annotations

import torch

from gpu_worker.kv_cache import KVPool, ReqToTokenPool, kv_bytes_per_token


def test_req_to_token_write_scatters_each_request_at_its_start():
    pool = ReqToTokenPool(num_rows=3, max_context_len=8, device="cpu")
    pool.write(
        rows=torch.tensor([2, 1, 3]),
        start_positions=torch.tensor([0, 5, 2]),
        slots=torch.tensor([11, 12, 13, 21, 22, 31]),
        lens=torch.tensor([3, 2, 1]),
    )
    expected = torch.zeros(4, 8, dtype=torch.int32)
    expected[2, 0:3] = torch.tensor([11, 12, 13])
    expected[1, 5:7] = torch.tensor([21, 22])
    expected[3, 2] = 31
    assert torch.equal(pool.req_to_token, expected)
    assert pool.slots_of(2, 3).tolist() == [11, 12, 13]


def test_kv_pool_set_and_move_with_overlap():
    pool = KVPool(
        num_slots=8,
        page_size=2,
        num_layers=2,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.float32,
        device="cpu",
    )
    assert pool.k_buffers[0].shape == (10, 2, 3)
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    loc = torch.tensor([4, 5, 6])
    for layer in range(2):
        pool.set_kv(layer, loc, k + layer, v - layer)
    pool.move_kv(dst_loc=torch.tensor([3, 4, 5]), src_loc=loc)  # overlapping ranges
    for layer in range(2):
        keys, values = pool.get_kv(layer)
        torch.testing.assert_close(keys[3:6], k + layer)
        torch.testing.assert_close(values[3:6], v - layer)
    assert pool.bytes_per_token() == kv_bytes_per_token(2, 2, 3, torch.float32) == 2 * 2 * 2 * 3 * 4
    assert kv_bytes_per_token(2, 2, 3, torch.bfloat16) == 2 * 2 * 2 * 3 * 2
