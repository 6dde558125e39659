"""EAGLE and EAGLE-3 on a launched server: greedy output equals transformers' greedy output
token for token (16 concurrent requests; chains and trees; page sizes 1 and 4; prefill chunks
of 4 and 16), speculative metrics, full acceptance of a draft that always agrees with its
target, and sampling at temperature > 0."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.reference import check_parity
from tests.e2e.server import Server
from tests.gpu_worker.draft_checkpoints import (
    make_agreeing_eagle_draft,
    make_bigram_target,
    make_tiny_eagle3_draft,
    make_tiny_eagle_draft,
)
from tests.tokenizer_fixture import make_tiny_tokenizer
from tools.step_trace_summary import load

pytestmark = pytest.mark.e2e
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def drafts(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    target = tiny_model_dirs["llama"]
    bigram = make_bigram_target(str(root / "bigram"), max_position_embeddings=512)
    make_tiny_tokenizer(bigram)
    return {
        "EAGLE": make_tiny_eagle_draft(str(root / "eagle"), target),
        "EAGLE3": make_tiny_eagle3_draft(str(root / "eagle3"), target, draft_vocab_size=200),
        "bigram": bigram,
        "agreeing": make_agreeing_eagle_draft(str(root / "agreeing"), bigram),
    }


def spec_args(algorithm: str, draft: str, steps: int, topk: int, num_draft: int) -> list[str]:
    return [
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(num_draft),
    ]


@pytest.mark.parametrize(
    "algorithm, steps, topk, num_draft, page, chunk",
    [
        ("EAGLE", 3, 1, 4, 1, 4),
        ("EAGLE", 3, 3, 8, 4, 16),
        ("EAGLE3", 3, 1, 4, 4, 16),
        ("EAGLE3", 2, 2, 5, 1, 4),
    ],
)
def test_speculative_greedy_matches_transformers(
    tiny_model_dirs, drafts, algorithm, steps, topk, num_draft, page, chunk
):
    target = tiny_model_dirs["llama"]
    args = [
        "--model-path",
        target,
        "--page-size",
        str(page),
        "--chunked-prefill-size",
        str(chunk),
        *spec_args(algorithm, drafts[algorithm], steps, topk, num_draft),
    ]
    with Server(*args) as server:
        outputs = check_parity(target, server.url, vocab=320, seed=steps * topk + page)
        for out in outputs:
            meta = out["meta_info"]
            if meta["completion_tokens"] > 1:  # the first token comes from prefill
                assert meta["spec_verify_ct"] >= 1
                expected = meta["completion_tokens"] / meta["spec_verify_ct"]
                assert meta["spec_accept_length"] == pytest.approx(expected)
        info = httpx.get(server.url + "/server_info").json()
        assert info["speculative_algorithm"] == algorithm
        assert 1.0 <= info["avg_accept_length"] <= steps + 1
        metrics = httpx.get(server.url + "/metrics").text
        assert 'aerie_spec_accepted_tokens_total{position="0"}' in metrics


def test_agreeing_draft_gives_accept_length_s_plus_1(drafts):
    steps, num_verify = 3, 5
    args = ["--model-path", drafts["bigram"], *spec_args("EAGLE", drafts["agreeing"], steps, 2, 6)]
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {
            "max_new_tokens": 1 + num_verify * (steps + 1),
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    with Server(*args) as server:
        meta = httpx.post(server.url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["spec_verify_ct"] == num_verify  # every verify accepted all S drafts + bonus


def test_sampling_with_speculation_is_seeded(tiny_model_dirs, drafts):
    args = ["--model-path", tiny_model_dirs["llama"], *spec_args("EAGLE", drafts["EAGLE"], 3, 2, 6)]
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {
            "max_new_tokens": 24,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 7,
            "ignore_eos": True,
        },
    }
    with Server(*args) as server:
        a = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        b = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        other = dict(body, sampling_params=dict(body["sampling_params"], seed=8))
        c = httpx.post(server.url + "/generate", json=other, timeout=120).json()
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 24
    assert c["output_ids"] != a["output_ids"]


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    from tests.gpu_worker.mtp_checkpoints import make_tiny_mtp_target

    path = make_tiny_mtp_target(str(tmp_path_factory.mktemp("mtp") / "target"), num_mtp_layers=3)
    make_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("steps, page, chunk", [(3, 1, 4), (2, 4, 16)])
def test_mtp_greedy_matches_transformers(mtp_target, steps, page, chunk):
    args = [
        "--model-path",
        mtp_target,
        "--page-size",
        str(page),
        "--chunked-prefill-size",
        str(chunk),
        "--speculative-algorithm",
        "MTP",
        "--speculative-num-steps",
        str(steps),
    ]
    with Server(*args) as server:
        outputs = check_parity(mtp_target, server.url, vocab=320, seed=steps + page)
        assert any(out["meta_info"]["spec_verify_ct"] > 0 for out in outputs)
        info = httpx.get(server.url + "/server_info").json()
        assert info["speculative_algorithm"] == "MTP" and info["speculative_num_steps"] == steps


def _verify_counts(args: list[str], chunk: int) -> list[int]:
    """Per-request spec_verify_ct of 8 concurrent greedy requests on a fresh server."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[5 + i, 40 + 3 * i, 7, 9 + i, 11, 12 + 2 * i] * (1 + i % 3) for i in range(8)]

    def one(ids: list[int]) -> int:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        }
        return httpx.post(server.url + "/generate", json=body, timeout=120).json()["meta_info"][
            "spec_verify_ct"
        ]

    with Server(*args, "--chunked-prefill-size", str(chunk)) as server:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, prompts))


@pytest.mark.parametrize("algorithm", ["EAGLE", "MTP"])
def test_verify_counts_do_not_depend_on_prefill_chunking(
    tiny_model_dirs, drafts, mtp_target, algorithm
):
    """With a deterministic draft, a request's verify steps depend only on its tokens, not on
    how its prompt was chunked (a wrong chunk-boundary tail changes them: SGLang #26329)."""
    if algorithm == "EAGLE":
        args = [
            "--model-path",
            tiny_model_dirs["llama"],
            *spec_args("EAGLE", drafts["EAGLE"], 3, 1, 4),
        ]
    else:
        args = ["--model-path", mtp_target, "--speculative-algorithm", "MTP"]
    assert _verify_counts(args, 3) == _verify_counts(args, 64)


def step_costs_json(break_even: float) -> str:
    """Step costs whose iterations cost `break_even` plain steps at every batch size."""
    buckets = [1, 2, 4, 8, 16]
    return json.dumps(
        {
            "buckets": buckets,
            "plain_ms": {"greedy": [1.0] * 5, "sampled": [1.0] * 5},
            "speculative_ms": {"greedy": [break_even] * 5, "sampled": [break_even] * 5},
        }
    )


def test_adaptive_speculation_decodes_plainly_where_drafts_do_not_pay(
    tiny_model_dirs, drafts, tmp_path
):
    """Given step costs under which this random draft cannot pay (an iteration costing 3.5
    plain steps), the server decodes plainly but for its probes, and the output still equals
    transformers' greedy output; the choice shows in /metrics and /server_info, and the step
    trace tells plain steps ("decode") from iterations ("speculate")."""
    target = tiny_model_dirs["llama"]
    args = [
        "--model-path",
        target,
        *spec_args("EAGLE", drafts["EAGLE"], 2, 1, 3),
        "--speculative-step-costs",
        step_costs_json(3.5),
    ]
    trace_dir = tmp_path / "trace"
    with Server(*args, env={"AERIE_STEP_TRACE": f"1,100000,{trace_dir}"}) as server:
        check_parity(target, server.url, vocab=320, seed=5)
        check_parity(target, server.url, vocab=320, seed=6)
        metrics = httpx.get(server.url + "/metrics").text
        info = httpx.get(server.url + "/server_info").json()
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    plain = float(samples["aerie_spec_plain_steps_total"])
    verified = float(samples['aerie_spec_accepted_tokens_total{position="0"}'])
    assert plain > 0 and verified > 0  # the probes (and the first steps) still speculate
    assert plain > verified  # mostly plain
    assert info["speculative_adaptive"] == "on"
    assert info["spec_plain_steps"] == plain
    assert info["spec_break_even_accept_length"] == 3.5
    error = float(samples["aerie_spec_expected_accept_error"])
    assert info["spec_expected_accept_error"] == pytest.approx(error) and 0 < error < 1
    assert json.loads(info["speculative_step_costs"])["buckets"] == [1, 2, 4, 8, 16]
    modes = collections.Counter(mode for mode, _ in load(str(trace_dir))[1].values())
    assert modes["decode"] > modes["speculate"] > 0 and modes["extend"] > 0


def test_bad_step_costs_stop_the_launch_with_the_reason(tiny_model_dirs, drafts):
    args = [
        "--model-path",
        tiny_model_dirs["llama"],
        *spec_args("EAGLE", drafts["EAGLE"], 2, 1, 3),
        "--speculative-step-costs",
        '{"buckets": []}',
    ]
    result = subprocess.run(
        [sys.executable, "launch.py", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode != 0
    assert "--speculative-step-costs must be JSON like" in result.stderr + result.stdout
