"""The prefix cache on a launched server: requests that share a prefix with finished ones (the
same prompt again, a second turn holding the first answer, a shorter shared prefix) reuse its
KV, for the target and every draft, and still give transformers' greedy output token for token
and, with a draft, the same verify counts as without the cache (the drafts' reused KV is what
they would have computed): plain, EAGLE, EAGLE-3 and MTP; page sizes 1 and 4; prefill chunks of
4 and 16. A full cache evicts least recently used prefixes; `--disable-radix-cache` turns it
off."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.reference import hf_greedy
from tests.e2e.server import Server
from tests.gpu_worker.draft_checkpoints import make_tiny_eagle3_draft, make_tiny_eagle_draft
from tests.tokenizer_fixture import make_tiny_tokenizer

pytestmark = pytest.mark.e2e
VOCAB = 320


def generate(url: str, ids: list[int], max_new: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_reuse(model_dir: str, url: str, page: int, lookahead: int, seed: int) -> list[int]:
    """A first request, then a wave that shares its prefix in every way a chat does; each
    output equals transformers' and each reuse is as long as the cache allows (none with
    lookahead None: the cache is off). -> the wave's verify counts."""
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(37)]
    first = base + [5, 6, 7]
    out = generate(url, first, 12)
    assert out["output_ids"] == hf_greedy(model_dir, first, 12)
    assert out["meta_info"]["cached_tokens"] == 0
    # Every position but the newest has KV: the first answer is cached too.
    second_turn = first + out["output_ids"] + [8, 9, 10]
    wave = [
        (second_turn, 10, len(first) + len(out["output_ids"]) - 1),
        (first, 9, len(first)),  # the same prompt again
        (base + [11, 12], 8, len(base)),
        (base[:20] + [rng.randrange(3, VOCAB) for _ in range(9)], 7, 20),
    ]
    with ThreadPoolExecutor(len(wave)) as pool:
        outs = list(pool.map(lambda w: generate(url, w[0], w[1]), wave))
    for (ids, max_new, matched), got in zip(wave, outs, strict=True):
        assert got["output_ids"] == hf_greedy(model_dir, ids, max_new), f"prompt {ids}"
        if lookahead is None:
            expected = 0
        else:
            usable = min(matched // page * page - lookahead, len(ids) - 1)
            expected = max(usable // page * page, 0)
        assert got["meta_info"]["cached_tokens"] == expected, (ids, got["meta_info"])
    return [got["meta_info"]["spec_verify_ct"] for got in outs]


@pytest.fixture(scope="module")
def drafts(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    target = tiny_model_dirs["llama"]
    return {
        "EAGLE": make_tiny_eagle_draft(str(root / "eagle"), target),
        "EAGLE3": make_tiny_eagle3_draft(str(root / "eagle3"), target, draft_vocab_size=200),
    }


@pytest.mark.parametrize(
    "algorithm, spec, page, chunk",
    [
        (None, [], 1, 4),
        (None, [], 4, 16),
        ("EAGLE", ["3", "1", "4"], 1, 4),
        ("EAGLE3", ["2", "2", "5"], 4, 16),
    ],
)
def test_reused_prefix_gives_the_same_greedy_output(
    tiny_model_dirs, drafts, algorithm, spec, page, chunk
):
    target = tiny_model_dirs["llama"]
    args = ["--model-path", target, "--page-size", str(page), "--chunked-prefill-size", str(chunk)]
    if algorithm is None:
        args += spec
    else:
        steps, topk, num_draft = spec
        args += ["--speculative-algorithm", algorithm]
        args += ["--speculative-draft-model-path", drafts[algorithm]]
        args += ["--speculative-num-steps", steps, "--speculative-eagle-topk", topk]
        args += ["--speculative-num-draft-tokens", num_draft]
    with Server(*args) as server:
        lookahead = 0 if algorithm is None else 1
        verify_counts = check_reuse(target, server.url, page, lookahead, seed=page + chunk)
        info = httpx.get(server.url + "/server_info").json()
        assert 0 < info["cached_prefill_tokens"] < info["prefill_tokens"]
        hit_rate = info["cached_prefill_tokens"] / info["prefill_tokens"]
        assert info["prefix_cache_hit_rate"] == pytest.approx(hit_rate)
        # Idle: everything cached is evictable.
        assert 0 < info["prefix_cache_tokens"] == info["prefix_cache_evictable_tokens"]
        metrics = httpx.get(server.url + "/metrics").text
        hits = f"aerie_prefix_cache_hit_tokens_total {float(info['cached_prefill_tokens'])}"
        assert hits in metrics
    if algorithm is not None:  # every draft's reused KV is what it would have computed
        with Server(*args, "--disable-radix-cache") as server:
            assert check_reuse(target, server.url, page, None, seed=page + chunk) == verify_counts


def test_a_full_cache_evicts_the_least_recently_used_prefix(tiny_model_dirs):
    """32 pages of 4 tokens hold two finished 40-token prompts (11 pages each) but not three:
    admitting the third evicts the oldest; sending the oldest again evicts the next oldest."""
    target = tiny_model_dirs["llama"]
    rng = random.Random(7)
    a, b, c = ([rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(3))
    args = ["--model-path", target, "--page-size", "4", "--max-total-tokens", "128"]
    with Server(*args) as server:
        cached = {}
        for name, ids in (("a", a), ("b", b), ("c", c), ("a again", a), ("c again", c)):
            out = generate(server.url, ids, 8)
            assert out["output_ids"] == hf_greedy(target, ids, 8), name
            cached[name] = out["meta_info"]["cached_tokens"]
            info = httpx.get(server.url + "/server_info").json()
            assert info["prefix_cache_tokens"] <= 128
    assert cached == {"a": 0, "b": 0, "c": 0, "a again": 0, "c again": 36}


def test_a_tiny_pool_retracts_and_evicts_without_changing_outputs(tiny_model_dirs):
    """12 concurrent requests over three shared stems in a pool of 192 tokens: admission,
    retraction and eviction all run on cached pages, and every output is still transformers'."""
    target = tiny_model_dirs["llama"]
    rng = random.Random(11)
    stems = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(3)]
    tails = [[rng.randrange(3, VOCAB) for _ in range(i % 5 + 1)] for i in range(12)]
    prompts = [stems[i % 3] + tail for i, tail in enumerate(tails)]
    args = ["--model-path", target, "--page-size", "4", "--max-total-tokens", "192"]
    args += ["--chunked-prefill-size", "16", "--schedule-conservativeness", "0"]
    with Server(*args) as server:
        generate(server.url, stems[0] + [3], 4)  # something cached before the wave
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: generate(server.url, ids, 24), prompts))
        info = httpx.get(server.url + "/server_info").json()
    for ids, got in zip(prompts, outs, strict=True):
        assert got["output_ids"] == hf_greedy(target, ids, 24), f"prompt {ids}"
    assert info["num_retractions"] > 0 and info["cached_prefill_tokens"] > 0


def test_no_page_leaks_after_aborts_and_a_flush_empties_the_cache(tiny_model_dirs):
    """Streams cut off by their clients and finished requests alike leave only unused cached
    pages behind; /flush_cache drops them."""
    target = tiny_model_dirs["llama"]
    rng = random.Random(5)
    stem = [rng.randrange(3, VOCAB) for _ in range(30)]
    with Server("--model-path", target) as server:

        def one(i: int) -> None:
            body = {
                "input_ids": stem + [3 + i],
                "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
                "stream": i % 2 == 0,
            }
            if not body["stream"]:
                generate(server.url, body["input_ids"], 16)
                return
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 3:
                        break  # the client goes away: the server aborts the request

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(16)))
        deadline = time.monotonic() + 30
        while True:  # the scheduler's stats arrive a moment after the last response
            info = httpx.get(server.url + "/server_info").json()
            if (
                info["num_running"] == 0
                and info["kv_used_tokens"] == 0
                or (time.monotonic() > deadline)
            ):
                break
            time.sleep(0.2)
        assert info["kv_used_tokens"] == 0 and info["num_running"] == 0
        assert 0 < info["prefix_cache_tokens"] == info["prefix_cache_evictable_tokens"]
        # POST with a JSON body only: a GET (any web page can make one) changes nothing.
        assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 405
        r = httpx.post(server.url + "/flush_cache", json={}, timeout=30)
        assert r.status_code == 200, r.text
        flushed = r.json()
    assert flushed["flushed"] and flushed["replicas"][0]["prefix_cache_tokens"] == 0
    assert flushed["replicas"][0]["kv_whole"] is True


def test_mtp_reuses_every_layers_kv(tmp_path):
    from tests.gpu_worker.mtp_checkpoints import make_tiny_mtp_target

    steps = 3
    target = make_tiny_mtp_target(str(tmp_path / "target"), num_mtp_layers=steps)
    make_tiny_tokenizer(target)
    args = ["--model-path", target, "--chunked-prefill-size", "4"]
    args += ["--speculative-algorithm", "MTP", "--speculative-num-steps", str(steps)]
    with Server(*args) as server:
        verify_counts = check_reuse(target, server.url, 1, steps, seed=3)
    with Server(*args, "--disable-radix-cache") as server:
        assert check_reuse(target, server.url, 1, None, seed=3) == verify_counts


def test_disabled_cache_prefills_everything_and_openai_reports_cached_tokens(tiny_model_dirs):
    target = tiny_model_dirs["llama"]
    body = {"model": "m", "prompt": "the same prompt, twice over", "max_tokens": 4}
    usage = []
    for flag in ([], ["--disable-radix-cache"]):
        with Server("--model-path", target, *flag) as server:
            for _ in range(2):
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                usage.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            info = httpx.get(server.url + "/server_info").json()
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert usage == [0, prompt_tokens - 1, 0, 0]
    assert info["prefix_cache_tokens"] == 0 and info["cached_prefill_tokens"] == 0
