"""Greedy output of the launched server equals transformers' greedy generate, token for token,
for many concurrent requests of different lengths, with small prefill chunks and page sizes."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.reference import check_parity as _check_parity
from tests.e2e.server import Server

pytestmark = pytest.mark.e2e


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
        # 8 requests: the 135M model in float32 takes most of a second a step on 2 cores.
        _check_parity(default_model_dir, server.url, vocab=49152, seed=chunk, num_requests=8)


def test_retraction_keeps_outputs_unchanged(tiny_model_dirs):
    """A KV cache too small for all requests at once forces retraction and recomputation. The
    requests go as one batch, so that they run together however loaded the machine is, into 96
    positions (476 in all; the largest needs 46): 5-8 retractions per run, measured on 2 busy
    cores. 160 positions and separate HTTP requests retracted 0-2 times, so CI once saw none."""
    path = tiny_model_dirs["llama"]
    args = (
        "--model-path",
        path,
        "--max-total-tokens",
        "96",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "16",
        "--schedule-conservativeness",
        "0",
    )
    with Server(*args) as server:
        _check_parity(path, server.url, vocab=320, seed=7, one_batch=True)
        stats = httpx.get(server.url + "/server_info", timeout=10).json()
        assert stats["max_total_tokens"] == 96
        assert stats["num_retractions"] > 0, "the test did not exercise retraction"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_in_the_interpreter_matches_transformers(tiny_model_dirs, arch):
    """The launched server with --attention-backend triton on CPU (Triton's interpreter, which
    the test run switches on): every Triton kernel end to end, through the padded graph path.
    Eight requests of up to 12 new tokens (still several graph buckets, chunked and paged
    prefill): the interpreter takes seconds a step."""
    path = tiny_model_dirs[arch]
    args = (
        "--model-path",
        path,
        "--attention-backend",
        "triton",
        "--chunked-prefill-size",
        "16",
        "--page-size",
        "4",
    )
    with Server(*args) as server:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["attention_backend"] == "triton" and info["cuda_graph_max_bs"] > 0
        _check_parity(path, server.url, vocab=320, seed=3, num_requests=8, max_new=12)
