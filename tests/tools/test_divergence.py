"""tools/divergence.py: where two runs part, and whether the reference's logits there make it a
near-tie or a suspect."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.reference import hf_greedy
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tools import divergence


def test_the_first_difference_counts_an_ending():
    assert divergence.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert divergence.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert divergence.first_difference([1, 2], [1, 2, 3]) == 2
    assert divergence.first_difference([], [4]) == 0


def fake_logits(values: dict[int, float], vocab: int = 8):
    def logits_of(ids: list[int]) -> torch.Tensor:
        logits = torch.full((vocab,), -4.0)
        for token, value in values.items():
            logits[token] = value
        return logits

    return logits_of


def test_a_gap_within_rounding_of_the_scale_is_a_near_tie():
    tie = divergence.explain(0, [1], [2, 3], [2, 4], fake_logits({3: 16.0, 4: 16.0 - 0.06}))
    assert tie is not None and tie.position == 1 and (tie.token_a, tie.token_b) == (3, 4)
    assert tie.scale == 16.0 and tie.relative_gap == pytest.approx(0.06 / 16, rel=1e-5)
    assert tie.near_tie and tie.top_two_picked  # 0.0037 < 2^-7
    clear = divergence.explain(0, [1], [2, 3], [2, 4], fake_logits({3: 16.0, 4: 15.0}))
    assert clear is not None and not clear.near_tie and clear.shared_share == 0.5
    below = divergence.explain(0, [1], [3], [6], fake_logits({3: 16.0, 4: 15.9, 6: 1.0}))
    assert below is not None and not below.top_two_picked
    # A run that stopped: judged by the top two (here one token stands clear)
    ended = divergence.explain(0, [1], [2], [2, 4], fake_logits({4: 9.0, 5: 1.0}))
    assert ended is not None and ended.token_a is None and ended.logit_b == 9.0
    assert ended.relative_gap == pytest.approx(8 / 9) and not ended.near_tie


def test_failed_answers_and_endings_are_counted_apart():
    logits_of = fake_logits({3: 16.0, 4: 15.0})
    run_a = [
        {"prompt_ids": [1], "output_ids": [3, 3]},
        {"prompt_ids": [2], "output_ids": [3], "error": ""},
        {"prompt_ids": [5], "output_ids": [], "error": "HTTP 503"},
    ]
    run_b = [
        {"prompt_ids": [1], "output_ids": [3, 4]},  # a clear flip: a suspect
        {"prompt_ids": [2], "output_ids": [3, 3]},  # a ends first: not judged
        {"prompt_ids": [5], "output_ids": [3]},
        {"prompt_ids": [6], "output_ids": [3]},  # only b has it
    ]
    report = divergence.compare(run_a, run_b, logits_of)
    assert (report["prompts"], report["failed"], report["identical"]) == (2, 1, 0)
    assert (report["ended"], report["near_ties"], report["suspects"]) == (1, 0, 1)
    with pytest.raises(ValueError, match="different prompts"):
        divergence.compare(run_a, list(reversed(run_b)), logits_of)


def test_the_reference_logits_at_a_flipped_token(tmp_path):
    """Run b takes the runner-up at position 3: the tool finds it and reports the gap the
    float32 reference has there; with a threshold above that gap it is a near-tie, below a
    suspect (exit status 1)."""
    model = make_tiny_checkpoint(str(tmp_path / "model"), "llama", vocab_size=96)
    logits_of = divergence.reference_logits(model, "cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    run_a = [{"prompt_ids": p, "output_ids": hf_greedy(model, p, 8)} for p in prompts]
    flipped = list(run_a[1]["output_ids"])
    logits = logits_of(prompts[1] + flipped[:3])
    top2 = torch.topk(logits, 2)
    assert flipped[3] == int(top2.indices[0])  # the reference agrees with greedy
    flipped[3] = int(top2.indices[1])
    run_b = [run_a[0], {"prompt_ids": prompts[1], "output_ids": flipped}]
    gap = float(top2.values[0] - top2.values[1]) / float(logits.abs().max())

    report = divergence.compare(run_a, run_b, logits_of, tie=2 * gap)
    assert (report["identical"], report["near_ties"], report["suspects"]) == (1, 1, 0)
    assert report["outside_top_two"] == 0
    (found,) = report["divergences"]
    assert (found["index"], found["position"]) == (1, 3)
    assert found["relative_gap"] == pytest.approx(gap, rel=1e-5)
    assert report["mean_shared_share"] == pytest.approx((1 + 3 / 8) / 2)

    paths = []
    for name, run in (("a", run_a), ("b", run_b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    argv = [str(paths[0]), str(paths[1]), "--model-path", model, "--device", "cpu"]
    output = tmp_path / "report.json"
    assert divergence.main([*argv, "--tie", str(gap / 2), "--output", str(output)]) == 1
    assert json.loads(output.read_text())["suspects"] == 1
    assert divergence.main([*argv, "--tie", str(2 * gap)]) == 0
