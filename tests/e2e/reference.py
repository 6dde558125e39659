"""Reference outputs from Hugging Face transformers' own greedy `generate`."""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # parity runs use ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = _load(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt_ids) :].tolist()


NUM_REQUESTS = 16


def _requests(
    vocab: int, seed: int, num: int = NUM_REQUESTS, max_new: int = 24
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, max_new))
        for _ in range(num)
    ]


def _greedy(max_new: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


def _post_generate(url: str, body: dict):
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _full_length(out: dict, max_new: int) -> dict:
    assert out["meta_info"]["completion_tokens"] == max_new
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    return out


def _generate_all(url: str, requests: list[tuple[list[int], int]]) -> list[dict]:
    """Each request its own HTTP request, all sent concurrently."""

    def one(req: tuple[list[int], int]) -> dict:
        ids, max_new = req
        body = {"input_ids": ids, "sampling_params": _greedy(max_new)}
        return _full_length(_post_generate(url, body), max_new)

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, requests))


def _generate_batch(url: str, requests: list[tuple[list[int], int]]) -> list[dict]:
    """All requests in one /generate batch: they reach the scheduler together, whatever the
    load on the machine running the test (separate HTTP requests can arrive spread out)."""
    body = {
        "input_ids": [ids for ids, _ in requests],
        "sampling_params": [_greedy(max_new) for _, max_new in requests],
    }
    outputs = _post_generate(url, body)
    return [_full_length(out, n) for out, (_, n) in zip(outputs, requests, strict=True)]


def check_parity(
    model_dir: str,
    url: str,
    vocab: int,
    seed: int,
    one_batch: bool = False,
    num_requests: int = NUM_REQUESTS,
    max_new: int = 24,
) -> list[dict]:
    """Greedy outputs of num_requests concurrent requests of up to max_new new tokens (separate
    HTTP requests, or one batch with one_batch) equal transformers'; returns the responses."""
    requests = _requests(vocab, seed, num_requests, max_new)
    outputs = (_generate_batch if one_batch else _generate_all)(url, requests)
    for (ids, max_new), got in zip(requests, outputs, strict=True):
        assert got["output_ids"] == hf_greedy(model_dir, ids, max_new), f"prompt {ids}"
    return outputs
