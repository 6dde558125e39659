"""Token files, training rows and which positions learn, the draft vocabulary, and the
verifier's walk of the offline estimate: small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.estimate import walk, walk_rows
from training.recipes import draft_vocabulary
from training.rows import PAD_MULTIPLE, Rows, length_batches, make_rows
from training.tokens import TokenFile


def test_token_files_round_trip_with_their_extra_arrays(tmp_path):
    small = TokenFile.from_sequences([[1, 2, 3], [4], [5, 6]], [1, 1, 2], dev=np.array([1, 0, 1]))
    big = TokenFile.from_sequences([[70_000, 1]], [1], dev=np.array([0]))  # needs 32 bits
    small.save(str(tmp_path / "a.npz"))
    big.save(str(tmp_path / "b.npz"))
    with np.load(tmp_path / "a.npz") as f:
        assert f["tokens"].dtype == np.uint16
    joined = TokenFile.load(f"{tmp_path / 'a.npz'},{tmp_path / 'b.npz'}")
    assert [joined.sequence(i).tolist() for i in range(4)] == [[1, 2, 3], [4], [5, 6], [70_000, 1]]
    assert joined.prompt_lens.tolist() == [1, 1, 2, 1]
    assert joined.extra["dev"].tolist() == [1, 0, 1, 0]
    assert joined.num_response_tokens() == 2 + 0 + 0 + 1
    halves = joined.split(2)
    assert [len(h) for h in halves] == [2, 2]
    again = TokenFile.concat(halves)
    assert np.array_equal(again.tokens, joined.tokens)
    assert again.extra["dev"].tolist() == [1, 0, 1, 0]


def test_a_prompt_longer_than_its_sequence_is_refused():
    with pytest.raises(ValueError, match="prompt_lens"):
        TokenFile.from_sequences([[1, 2]], [3])


def test_rows_learn_where_the_predicted_token_is_a_response_token():
    # one row: prompt [10, 11, 12], response [13, 14, 15]; length 6
    data = TokenFile.from_sequences([[10, 11, 12, 13, 14, 15]], [3])
    rows = make_rows(data, np.array([0]), max_len=64)
    assert rows.shape == (1, PAD_MULTIPLE)
    # step 1 at t reads ids[t + 1] and predicts ids[t + 2]: response tokens are at 3, 4, 5
    assert rows.learns(1)[0, :6].tolist() == [False, True, True, True, False, False]
    assert rows.shifted_ids(1)[0, :6].tolist() == [11, 12, 13, 14, 15, 0]
    # step 3 predicts ids[t + 4]
    assert rows.learns(3)[0, :6].tolist() == [True, True, False, False, False, False]
    # the target's distribution is needed where it predicts a response token: u = 2, 3, 4
    assert rows.teaches()[0, :6].tolist() == [False, False, True, True, True, False]


def test_length_batches_cover_every_sequence_once_within_the_budget():
    rng = np.random.default_rng(0)
    seqs = [list(range(int(n))) for n in rng.integers(2, 40, size=50)]
    data = TokenFile.from_sequences(seqs, [1] * 50)
    indices = np.arange(50)
    batches = length_batches(data, indices, tokens_per_batch=120, max_len=32)
    assert sorted(np.concatenate(batches).tolist()) == list(range(50))
    for batch in batches:
        longest = min(int(data.lengths[batch].max()), 32)
        assert len(batch) == 1 or longest * len(batch) <= 120


def test_draft_vocabulary_takes_the_most_frequent_ids_in_id_order():
    counts = np.array([5, 0, 9, 5, 1, 9])
    assert draft_vocabulary(counts, 3).tolist() == [0, 2, 5]  # ties: the lower id first
    assert draft_vocabulary(counts, 4).tolist() == [0, 2, 3, 5]


def test_the_walk_jumps_by_each_accept_length():
    # run[t]: leading draft steps that agree at t (S = 3)
    run = np.array([0, 3, 1, 0, 2, 0, 0, 3, 1, 0, 0, 0])
    # t=0: 1 -> t=1: 4 -> t=5: 1 -> t=6: 1 -> t=7: 4 -> t=11 > last
    assert walk(run, first=0, last=10) == [1, 4, 1, 1, 4]
    assert walk(run, first=2, last=3) == [2]  # t=2: 2 -> t=4 > last


def test_rows_are_walked_from_the_end_of_their_prompt():
    # length 10, prompt 3: the first iteration follows position 2; with S=2 the last start is
    # position 10 - 2 - 2 = 6
    rows = Rows(torch.zeros(1, 10, dtype=torch.int64), torch.tensor([10]), torch.tensor([3]))
    run = np.array([[9, 9, 2, 0, 0, 1, 2, 0, 0, 0]])
    assert walk_rows(rows, run, depth=2) == [3, 2]  # t = 2, then 5, then 7 > 6
    # the first 3 response tokens (positions 3..5): iterations start at t <= 3 + 3 - 2 = 4
    assert walk_rows(rows, run, depth=2, response_tokens=3) == [3]
    assert walk_rows(rows, run, depth=2, response_tokens=1) == [3]  # t = 2 holds token 3
    assert walk_rows(rows, run, depth=2, response_tokens=100) == [3, 2]
