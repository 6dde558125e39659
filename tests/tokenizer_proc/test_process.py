"""TokenizerProcess with real sockets: readiness, request round trip (outputs detokenized
here), stats, drain, shutdown."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvloop

from aerie import endpoints
from aerie.codec import pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import (
    AbortRequest,
    BeginDrain,
    DrainDone,
    EngineReady,
    FinishReason,
    FrontendReady,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    TokenizedRequest,
)
from aerie.outputs import OutputsWriter
from aerie.transport import Receiver, Sender
from tests.tokenizer_proc.harness import wait_until
from tokenizer_proc.process import TokenizerProcess


@pytest.fixture
def config(tokenizer_dir, tmp_path) -> AerieConfig:
    return AerieConfig(runtime_dir=str(tmp_path)).replace(
        model={"model_path": tokenizer_dir, "tokenizer_path": tokenizer_dir, "context_length": 64},
        server={"port": 0, "zmq_port": 0, "log_level": "warning", "served_model_name": "tiny"},
    )


def step(rid: str, ids: list[int], finish: FinishReason | None = None) -> StepOutputs:
    writer = OutputsWriter()
    writer.add(0, rid, pack_ids(ids), finish=finish)
    return writer.take()[0]


def text_of(config: AerieConfig, ids: list[int]) -> str:
    from aerie.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(config.model.tokenizer_path).decode(ids, skip_special_tokens=True)


def post_in_background(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=10)))
    thread.start()
    return thread


@contextlib.contextmanager
def running_tokenizer(config: AerieConfig, to_tokenizer: Sender) -> Iterator[str]:
    """A TokenizerProcess running on a thread; yields its HTTP url, then sends it Shutdown and
    checks that it stopped."""
    proc = TokenizerProcess(config)
    runner = threading.Thread(target=lambda: uvloop.run(proc.run()))
    runner.start()
    try:
        yield proc.ready_info()["http_url"]
    finally:
        to_tokenizer.send(Shutdown("test over"))
        runner.join(10)
    assert not runner.is_alive()


def test_process_round_trip_drain_and_shutdown(config):
    scheduler = Receiver(endpoints.inbox(config, "scheduler"))
    launcher = Receiver(endpoints.inbox(config, "launcher"))
    to_tokenizer = Sender(endpoints.inbox(config, "tokenizer"))
    with running_tokenizer(config, to_tokenizer) as url:
        assert httpx.get(url + "/health").status_code == 503
        to_tokenizer.send(EngineReady({"page_size": 1}))
        assert launcher.recv(timeout_s=5) == FrontendReady("tokenizer")  # taken: it says so
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200)

        results: list[httpx.Response] = []
        thread = post_in_background(url + "/generate", {"input_ids": [5, 6]}, results)
        request = scheduler.recv(timeout_s=5)
        assert isinstance(request, TokenizedRequest) and unpack_ids(request.input_ids) == [5, 6]
        assert request.frontend == 0
        to_tokenizer.send(step(request.rid, [40, 41], FinishReason("stop", 9)))
        thread.join(10)
        text = results[0].json()["text"]
        assert text == text_of(config, [40, 41]) and len(text) >= 2
        assert results[0].json()["output_ids"] == [40, 41]
        assert results[0].json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": 9}
        assert results[0].json()["meta_info"]["prompt_tokens"] == 2

        to_tokenizer.send(SchedulerStats(3, 0, 10, 100, 1.0))
        assert wait_until(lambda: httpx.get(url + "/server_info").json()["num_running"] == 3)

        thread = post_in_background(url + "/generate", {"input_ids": [7]}, results)
        held = scheduler.recv(timeout_s=5)
        to_tokenizer.send(BeginDrain(timeout_s=0.2))
        assert launcher.recv(timeout_s=5) == DrainDone(num_unfinished=1)
        assert scheduler.recv(timeout_s=5) == AbortRequest(held.rid)
        thread.join(10)
        assert results[1].status_code == 503  # cut off by the drain's end: retry elsewhere
        assert "shutting down" in results[1].json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.post(url + "/generate", json={"input_ids": [7]}).status_code == 503
    for sock in (scheduler, launcher, to_tokenizer):
        sock.close()


def test_requests_cut_off_by_shutdown_get_a_json_503_or_a_final_error_event(config, monkeypatch):
    """Requests in flight at Shutdown (no drain: a process died) used to wait for uvicorn's
    graceful timeout and be cancelled: a text/plain 500, a stream cut without an end. They are
    answered at once now (the graceful timeout is made longer than the clients wait)."""
    monkeypatch.setattr("tokenizer_proc.process.UVICORN_GRACEFUL_S", 60.0)
    scheduler = Receiver(endpoints.inbox(config, "scheduler"))
    to_tokenizer = Sender(endpoints.inbox(config, "tokenizer"))
    with running_tokenizer(config, to_tokenizer) as url:
        to_tokenizer.send(EngineReady({"page_size": 1}))
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200)
        results: list[httpx.Response] = []
        plain = post_in_background(url + "/v1/completions", {"prompt": [5]}, results)
        with httpx.stream(
            "POST", url + "/generate", timeout=10, json={"input_ids": [6], "stream": True}
        ) as stream:
            held = [scheduler.recv(timeout_s=5) for _ in range(2)]
            streamed = held[1] if unpack_ids(held[1].input_ids) == [6] else held[0]
            to_tokenizer.send(step(streamed.rid, [40]))
            to_tokenizer.send(Shutdown("a process died"))
            lines = [line for line in stream.iter_lines() if line]
        plain.join(10)
    assert results[0].status_code == 503
    assert results[0].headers["content-type"] == "application/json"
    assert "shutting down" in results[0].json()["error"]["message"]
    assert json.loads(lines[0].removeprefix("data: "))["text"] == text_of(config, [40])
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
    assert lines[-1] == "data: [DONE]" and len(lines) == 3
    for sock in (scheduler, to_tokenizer):
        sock.close()


def test_taken_port_fails_with_a_clear_error(config):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"--port {port}"):
            TokenizerProcess(config.replace(server={"port": port}))


def test_random_seed_starts_the_sequence_of_drawn_seeds(config):
    """--random-seed reaches the frontend: the same value draws the same seeds for requests
    without one, another value other seeds."""

    def first_seeds(random_seed: int) -> list[int]:
        proc = TokenizerProcess(config.replace(model={"random_seed": random_seed}))
        try:
            return [proc.frontend.draw_seed() for _ in range(3)]
        finally:
            proc.close()

    assert first_seeds(9) == first_seeds(9) != first_seeds(10)


def test_each_frontend_takes_its_share_of_the_connection_cap_and_the_in_flight_limit(config):
    from tokenizer_proc.process import frontend_connections, frontend_limits
    from tokenizer_proc.tokenizer import Tokenizer

    tokenizer = Tokenizer(config.model.tokenizer_path)
    three = config.replace(
        server={"tokenizer_worker_num": 3},
        limits={"max_connections": 10, "max_queued_requests": 20},
        scheduler={"max_running_requests": 8},
    )
    assert frontend_connections(three) == 4  # 10 / 3, rounded up
    assert frontend_limits(three, tokenizer).max_in_flight == 10  # (8 + 20) / 3, rounded up
    one = three.replace(server={"tokenizer_worker_num": 1})
    assert frontend_connections(one) == 10
    assert frontend_limits(one, tokenizer).max_in_flight == 28
