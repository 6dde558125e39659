"""Greedy output of the launched server equals transformers' greedy generate, token for token,
for many concurrent requests of different lengths, with small prefill chunks and page sizes."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.reference import hf_greedy
from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 16


def _requests(vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 24))
        for _ in range(NUM_REQUESTS)
    ]


def _generate_all(url: str, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    def one(req):
        ids, max_new = req
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["completion_tokens"] == max_new
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        return out["output_ids"]

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, requests))


def _check_parity(model_dir: str, url: str, vocab: int, seed: int) -> None:
    requests = _requests(vocab, seed)
    outputs = _generate_all(url, requests)
    for (ids, max_new), got in zip(requests, outputs):
        assert got == hf_greedy(model_dir, ids, max_new), f"prompt {ids}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk, page", [(4, 1), (16, 4)])
def test_tiny_models_match_transformers(tiny_model_dirs, arch, chunk, page):
    path = tiny_model_dirs[arch]
    args = ("--model-path", path, "--chunked-prefill-size", str(chunk), "--page-size", str(page))
    with Server(*args) as server:
        _check_parity(path, server.url, vocab=320, seed=chunk + page)


@pytest.mark.parametrize("chunk, page", [(4, 1), (16, 4)])
def test_default_model_matches_transformers(default_model_dir, chunk, page):
    args = ("--chunked-prefill-size", str(chunk), "--page-size", str(page))
    with Server(*args) as server:
        _check_parity(default_model_dir, server.url, vocab=49152, seed=chunk)


def test_retraction_keeps_outputs_unchanged(tiny_model_dirs):
    """A KV cache too small for all requests at once forces retraction and recomputation."""
    path = tiny_model_dirs["llama"]
    args = ("--model-path", path, "--max-total-tokens", "160", "--page-size", "4",
            "--chunked-prefill-size", "16")
    with Server(*args) as server:
        _check_parity(path, server.url, vocab=320, seed=7)
        stats = httpx.get(server.url + "/server_info", timeout=10).json()
        assert stats["max_total_tokens"] == 160
        assert stats["num_retractions"] > 0, "the test did not exercise retraction"
