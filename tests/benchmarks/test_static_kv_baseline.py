"""The compiled baseline of bench_decode computes what the model computes: decoding a
sequence token by token through its static KV cache (eagerly here) gives transformers'
logits at every position."""

from __future__ import annotations

import torch

from benchmarks.static_kv_baseline import StaticKVDecoder
from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint, reference_logits
from tests.gpu_worker.runner_utils import runner_from_options


def test_static_kv_decoder_matches_transformers(tmp_path):
    for arch in ("llama", "qwen2"):
        path = make_tiny_checkpoint(str(tmp_path / arch), arch)
        runner = runner_from_options(
            path, max_total_tokens=64, max_running_requests=2, context_length=32
        )
        decoder = StaticKVDecoder(runner.model, batch_size=2, max_seq_len=32)
        ids = [[5, 17, 3, 99, 42, 7, 11], [8, 8, 1, 2, 200, 31, 4]]
        with torch.inference_mode():
            logits = [
                decoder(torch.tensor([a, b]), torch.tensor([p]))
                for p, (a, b) in enumerate(zip(*ids, strict=True))
            ]
        reference = load_reference(path)
        for b in range(2):
            expected = reference_logits(reference, ids[b])  # [len, V]
            got = torch.stack([step[b] for step in logits])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
