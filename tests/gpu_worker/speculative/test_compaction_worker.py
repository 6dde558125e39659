"""EagleWorker pieces whose mistakes greedy parity cannot see: accepted-path compaction
(after tree verification the target KV of the accepted path sits at seq .. seq +
accept_len - 1) and the EAGLE-3 draft-to-target vocabulary mapping."""

from __future__ import annotations

import torch

from tests.gpu_worker.speculative.test_eagle_worker import make_config
from tests.gpu_worker.speculative.test_mtp_worker import serve_one


def target_kv(worker, row: int, length: int) -> torch.Tensor:
    slots = worker.runner.req_to_token_pool.req_to_token[row, :length].long()
    return worker.runner.kv_pool.get_kv(0)[0][slots].clone()


def test_accepted_path_kv_is_moved_to_the_front(models):
    """With topk 3 the accepted nodes are not nodes 1, 2, 3 of the tree (siblings come first),
    so without compaction positions seq + j would keep the KV of the wrong nodes."""
    prompt = [30, 31, 32, 33]
    config = make_config(models["bigram"], "EAGLE", models["agreeing"], 3, 3, 7)
    worker, row, output = serve_one(config, prompt, 1 + 4 * 4)
    sequence = prompt + output
    m = len(sequence) - 1  # every position whose token is known has target KV
    reference, ref_row, _ = serve_one(make_config(models["bigram"]), sequence[:m], 1)
    torch.testing.assert_close(
        target_kv(worker, row, m), target_kv(reference, ref_row, m), atol=1e-5, rtol=1e-5
    )


def test_draft_top_k_maps_draft_vocab_ids_to_target_ids():
    """An EAGLE-3 draft scores its own small vocabulary; its top-k must be mapped through
    hot_token_id (d2t) before they become tree tokens."""
    from types import SimpleNamespace

    from gpu_worker.speculative.eagle_worker import EagleWorker

    hot = torch.tensor([70, 30, 90])  # draft id -> target id
    stub = SimpleNamespace(topk=2, draft=SimpleNamespace(hot_token_id=hot))
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    probs, ids = EagleWorker.draft_top_k(stub, SimpleNamespace(next_token_logits=logits))
    assert ids.tolist() == [[30, 90], [70, 90]]
    torch.testing.assert_close(probs.sum(-1) < 1, torch.tensor([True, True]))
