"""The default model with its shipped drafts, as a user starts it: `launch.py
--speculative-algorithm X` with no model or draft path. Greedy output is the plain server's,
token for token, and the trained drafts are accepted beyond the bonus token (the accept length
is reported per request and in /server_info)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

QUESTIONS = (
    "Write a short poem about the sea.",
    "What are three tips for staying healthy?",
    "Explain what a CPU does, in two sentences.",
    "List the days of the week.",
)
MAX_NEW = 48


def chat_greedy(url: str) -> list[dict]:
    """One question at a time: each runs alone, so its arithmetic is the same on both servers."""
    outputs = []
    for question in QUESTIONS:
        body = {
            "text": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        }
        response = httpx.post(url + "/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        outputs.append(response.json())
    return outputs


@pytest.fixture(scope="module")
def plain_outputs(default_server) -> list[dict]:
    return chat_greedy(default_server.url)


@pytest.mark.parametrize("algorithm, min_accept", [("EAGLE3", 1.3), ("EAGLE", 1.2), ("MTP", 1.3)])
def test_the_shipped_draft_serves_the_default_model(plain_outputs, algorithm, min_accept):
    with Server("--speculative-algorithm", algorithm, "--chunked-prefill-size", "64") as server:
        outputs = chat_greedy(server.url)
        info = httpx.get(server.url + "/server_info").json()
        assert f"speculative decoding: {algorithm}, draft " in server.log_text()
        assert f"drafts/SmolLM2-135M-Instruct/{algorithm.lower()}" in server.log_text()
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in plain_outputs]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    print(f"{algorithm}: accept length {tokens / verify:.2f}")
    assert verify > 0 and tokens / verify >= min_accept, tokens / verify
    assert info["speculative_algorithm"] == algorithm
    assert info["avg_accept_length"] >= min_accept
