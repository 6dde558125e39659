"""`--tp-size 2` on a launched CPU server (two worker processes over gloo): greedy output equals
transformers' token for token, for Llama and Qwen3 targets, plain and with EAGLE, EAGLE-3 and
MTP drafts sharded in the same group; a rank that dies stops the server with the rank named."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.reference import check_parity
from tests.e2e.server import Server, assert_no_orphans, child_named
from tests.gpu_worker.draft_checkpoints import make_tiny_eagle3_draft, make_tiny_eagle_draft

pytestmark = pytest.mark.e2e

TP2 = ("--tp-size", "2", "--chunked-prefill-size", "16", "--page-size", "4")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_match_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    with Server("--model-path", path, *TP2) as server:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["tp_size"] == 2
        child_named(server, "tp1_worker")  # the second rank is a process of its own
        check_parity(path, server.url, vocab=320, seed=11)
        assert server.stop() == 0  # every rank stops cleanly


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    from tests.gpu_worker.mtp_checkpoints import make_tiny_mtp_target
    from tests.tokenizer_fixture import make_tiny_tokenizer

    path = make_tiny_mtp_target(str(tmp_path_factory.mktemp("mtp") / "target"), num_mtp_layers=2)
    make_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "MTP"])
def test_two_ranks_with_a_draft_match_transformers(
    tiny_model_dirs, mtp_target, tmp_path, algorithm
):
    target = mtp_target if algorithm == "MTP" else tiny_model_dirs["llama"]
    args = [
        "--model-path",
        target,
        *TP2,
        "--speculative-algorithm",
        algorithm,
        "--speculative-num-steps",
        "2",
    ]
    if algorithm == "EAGLE":
        args += [
            "--speculative-draft-model-path",
            make_tiny_eagle_draft(str(tmp_path), target),
            "--speculative-eagle-topk",
            "2",
            "--speculative-num-draft-tokens",
            "4",
        ]
    elif algorithm == "EAGLE3":
        draft = make_tiny_eagle3_draft(str(tmp_path), target, draft_vocab_size=200)
        args += ["--speculative-draft-model-path", draft]
    with Server(*args) as server:
        outputs = check_parity(target, server.url, vocab=320, seed=5)
        assert any(o["meta_info"]["spec_verify_ct"] for o in outputs)


def test_a_dead_rank_stops_the_server_and_is_named(tiny_model_dirs):
    """Killed mid-generation: rank 0 is then waiting in a collective for the dead rank."""
    with Server("--model-path", tiny_model_dirs["llama"], *TP2) as server:
        body = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as stream:
            next(stream.iter_lines())  # generating
            os.kill(child_named(server, "tp1_worker"), signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=30)
        assert time.monotonic() - start < 10
        assert code == 1
        expected = "the tp1_worker process (tensor-parallel rank 1 of replica 0) exited"
        assert expected in server.log_text()
        assert_no_orphans(server)
