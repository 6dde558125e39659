"""Frontend: the seed each request runs with (drawn from the server's sequence for a request
that brings none) and its report in meta_info over HTTP, SSE and ZMQ; how often requests look
at the engine's processes."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.tokenizer_proc.harness import dealer, make_frontend, recv, send
from tokenizer_proc.validation import ValidationError


def prepared_seeds(
    tokenizer_dir: str, random_seed: int, bodies: list[dict], index: int = 0
) -> list[int]:
    """The seed of each sampling body, prepared in order by a fresh frontend (index: which of
    several)."""
    frontend, _ = make_frontend(tokenizer_dir, random_seed=random_seed, index=index)

    async def prepare_all() -> list[int]:
        return [
            (await frontend.prepare([5, 6], body, None, "input_ids")).sampling.seed
            for body in bodies
        ]

    return asyncio.run(prepare_all())


def test_unseeded_requests_get_a_sequence_of_seeds_fixed_by_random_seed(tokenizer_dir):
    unseeded = [{"temperature": 1.0}, {"temperature": 0.0}, {}, {"top_p": 0.5}] * 2
    seeds = prepared_seeds(tokenizer_dir, 3, unseeded)
    assert len(set(seeds)) == len(seeds)  # greedy requests draw theirs too
    assert all(0 <= s < 2**53 for s in seeds)  # exact as a JSON double, and in int64
    assert prepared_seeds(tokenizer_dir, 3, unseeded) == seeds  # a restart replays them
    assert not set(prepared_seeds(tokenizer_dir, 4, unseeded)) & set(seeds)
    # Each of several frontends draws a sequence of its own, replayed by a restart too.
    second = prepared_seeds(tokenizer_dir, 3, unseeded, index=1)
    assert not set(second) & set(seeds)
    assert prepared_seeds(tokenizer_dir, 3, unseeded, index=1) == second
    # A client's seed is kept and takes no draw from the sequence.
    mixed = [{}, {"seed": 7}, {"temperature": 1.0}, {"seed": 0}, {"seed": -(2**63)}]
    assert prepared_seeds(tokenizer_dir, 3, mixed) == [seeds[0], 7, seeds[1], 0, -(2**63)]


def test_meta_info_reports_the_seed_each_request_ran_with(live):
    server, _, engine = live
    body = {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 3}}
    out = httpx.post(server.url + "/generate", json=body).json()
    seeds = [r.sampling.seed for r in engine.submitted]
    assert None not in seeds and len(set(seeds)) == 2  # one seed per prompt of a batch
    assert [o["meta_info"]["seed"] for o in out] == seeds

    body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 4, "seed": 42}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        events = [
            json.loads(line[len("data: ") :])
            for line in r.iter_lines()
            if line.startswith("data: {")
        ]
    assert events and all(e["meta_info"]["seed"] == 42 for e in events)
    assert engine.submitted[-1].sampling.seed == 42

    sock = dealer(server.zmq_address)
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    send(sock, {"op": "generate", "req_id": 1, "body": body})
    replies = [recv(sock)]
    while replies[-1]["event"] != "done":
        replies.append(recv(sock))
    drawn = engine.submitted[-1].sampling.seed
    assert drawn is not None and drawn not in seeds
    assert all(r["data"]["meta_info"]["seed"] == drawn for r in replies)
    sock.close()

    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].sampling.seed not in (None, drawn, *seeds)


def test_requests_look_at_the_engine_processes_at_most_every_ttl(tokenizer_dir, monkeypatch):
    """Health checks look at the engine's processes every time; requests reuse a look that is
    under LIVENESS_TTL_S old, and a process found gone stays gone."""
    import tokenizer_proc.frontend as frontend_module

    looks = []

    def alive(pid):
        looks.append(pid)
        return pid != 13

    monkeypatch.setattr(frontend_module, "process_alive", alive)
    clock = [100.0]
    monkeypatch.setattr(frontend_module.time, "monotonic", lambda: clock[0])
    frontend, _ = make_frontend(tokenizer_dir)
    frontend.mark_ready({}, {"scheduler": 11, "gpu_worker": 12})
    frontend.check_accepting()
    frontend.check_accepting()
    assert looks == [11, 12]  # the second request reused the first look
    clock[0] += 2 * frontend_module.LIVENESS_TTL_S
    frontend.check_accepting()
    assert looks == [11, 12, 11, 12]
    assert frontend.unhealthy_reason() is None and len(looks) == 6  # health: every time
    frontend.pids["detokenizer"] = 13
    assert "detokenizer process is gone" in frontend.unhealthy_reason()
    frontend.pids["detokenizer"] = 14  # gone for good, whatever a later look would say
    with pytest.raises(ValidationError, match="detokenizer process is gone"):
        frontend.check_accepting()


def test_a_frontend_opens_with_the_launchers_flag_not_before(tokenizer_dir):
    """Holding the engine's info is not enough: a frontend answers 503 until the launcher's
    shared flag opens every frontend at once, so /health cannot say 200 on one frontend while
    another still refuses requests as not ready."""
    import multiprocessing

    frontend, _ = make_frontend(tokenizer_dir, ready=False)
    frontend.open_flag = multiprocessing.get_context("spawn").Value("b", 0, lock=False)
    frontend.mark_ready({"page_size": 1, "max_total_tokens": 1000})
    assert frontend.unhealthy_reason() == "the engine is not ready yet"
    with pytest.raises(ValidationError, match="not ready yet"):
        frontend.check_accepting()
    frontend.open_flag.value = 1
    assert frontend.unhealthy_reason() is None
    frontend.check_accepting()
