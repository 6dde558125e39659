from __future__ import annotations

import torch

from gpu_worker.step.forward_batch import ForwardMode, build_forward_batch


def test_build_forward_batch_lays_out_requests_in_order():
    batch = build_forward_batch(
        ForwardMode.EXTEND,
        input_ids=[[7, 8, 9], [4]],
        committed_lens=[2, 5],
        out_slots=[[30, 31, 12], [40]],
        rows=[3, 1],
        device="cpu",
    )
    assert batch.input_ids.tolist() == [7, 8, 9, 4]
    assert batch.positions.tolist() == [2, 3, 4, 5]
    assert batch.out_cache_loc.tolist() == [30, 31, 12, 40]
    assert batch.rows.tolist() == [3, 1]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [5, 6]
    assert batch.extend_seq_lens_cpu == [3, 1] and batch.committed_lens_cpu == [2, 5]
    assert batch.sample_indices().tolist() == [2, 3]  # last token of each request
    assert batch.batch_size == 2 and batch.num_tokens == 4


def test_sample_indices_and_custom_mask_for_verify():
    mask = torch.tensor([[[1, 0], [1, 1]], [[1, 0], [0, 1]]], dtype=torch.bool)  # [bs, 2, 2]
    batch = build_forward_batch(
        ForwardMode.TARGET_VERIFY,
        [[1, 2], [3, 4]],
        [1, 3],
        [[5, 6], [7, 8]],
        [1, 2],
        "cpu",
        positions=[[1, 2], [3, 4]],
        custom_mask=mask,
    )
    assert batch.sample_indices().tolist() == [0, 1, 2, 3]
    assert batch.positions.tolist() == [1, 2, 3, 4]
    assert batch.custom_mask.shape == (2, 2, 2) and torch.equal(batch.custom_mask, mask)


def test_slot_count_must_match_input_count():
    try:
        build_forward_batch(ForwardMode.DECODE, [[1]], [0], [[1, 2]], [1], "cpu")
    except ValueError as e:
        assert "out slots" in str(e)
    else:
        raise AssertionError("mismatched slots accepted")


def test_staging_uploads_many_arrays_in_one_copy_and_grows():
    import numpy as np

    from gpu_worker.step.host_batch import Staging

    staging = Staging("cpu", capacity=4)
    arrays = [np.arange(3), np.array([7]), np.arange(10, 16)]  # 10 values > capacity 4
    views = staging.upload(arrays)
    assert [v.tolist() for v in views] == [a.tolist() for a in arrays]
    again = staging.upload([np.array([1, 2])])  # the other buffer: earlier views stay intact
    assert again[0].tolist() == [1, 2] and views[2].tolist() == list(range(10, 16))


def test_staging_starts_every_view_16_byte_aligned():
    """Triton specializes kernels on pointer alignment: views at odd int64 offsets would make a
    prefill of another batch shape compile again."""
    import numpy as np

    from gpu_worker.step.host_batch import Staging

    staging = Staging("cpu", capacity=64)
    arrays = [
        np.arange(3),
        np.array([7], dtype=np.int32),
        np.array([], dtype=np.int64),
        np.arange(10, 15),
    ]
    views = staging.upload(arrays)
    assert [v.tolist() for v in views] == [a.tolist() for a in arrays]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    dst = torch.zeros(16, dtype=torch.int64)
    staging.upload_into(dst, arrays)  # a graph's static inputs stay back to back
    assert dst[:9].tolist() == [0, 1, 2, 7, 10, 11, 12, 13, 14]
