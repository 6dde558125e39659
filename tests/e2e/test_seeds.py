"""Per-request seeds on a launched server: a request without a seed gets its own from a
sequence that `--random-seed` fixes, and the seed `meta_info` reports reproduces the answer."""

from __future__ import annotations

import httpx
import pytest

from aerie.client import Client
from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

PROMPT = [5, 6, 7, 8]
SAMPLED = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def generate(server: Server, sampling: dict) -> tuple[list[int], int]:
    """(output ids, reported seed) of one /generate request for PROMPT."""
    body = {"input_ids": PROMPT, "sampling_params": sampling}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["seed"]


def test_unseeded_requests_draw_their_own_seeds_replayed_by_a_restart(tiny_model_dirs):
    """24 tokens at temperature 1 of a random tiny model (its next-token distributions are
    close to uniform over 384 ids): two draws agree by chance with negligible probability.
    One frontend: each frontend draws its own sequence, and which frontend a connection
    reaches is the kernel's choice."""
    args = ("--model-path", tiny_model_dirs["llama"], "--random-seed", "5")
    args += ("--tokenizer-worker-num", "1")
    with Server(*args) as server:
        (a, seed_a), (b, seed_b) = generate(server, SAMPLED), generate(server, SAMPLED)
        assert seed_a != seed_b and a != b and len(a) == len(b) == 24
        assert generate(server, {**SAMPLED, "seed": seed_b}) == (b, seed_b)
        greedy, greedy_seed = generate(server, GREEDY)
        assert isinstance(greedy_seed, int)  # every answer reports its seed
        assert generate(server, {**GREEDY, "seed": greedy_seed + 1})[0] == greedy
    with Server(*args) as server, Client(server.zmq_address) as client:
        replayed = [client.generate(input_ids=PROMPT, sampling_params=SAMPLED) for _ in (a, b)]
    got = [(r["output_ids"], r["meta_info"]["seed"]) for r in replayed]
    assert got == [(a, seed_a), (b, seed_b)]
