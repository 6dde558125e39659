"""TokenizerProcess with real sockets: readiness, request round trip, stats, drain, shutdown."""

from __future__ import annotations

import socket
import threading

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
    SchedulerStats,
    Shutdown,
    TextDelta,
    TextDeltas,
    TokenizedRequest,
)
from aerie.transport import Receiver, Sender
from tests.tokenizer_proc.harness import wait_until
from tokenizer_proc.process import TokenizerProcess


@pytest.fixture
def config(tokenizer_dir, tmp_path) -> AerieConfig:
    return AerieConfig(runtime_dir=str(tmp_path)).replace(
        model={"model_path": tokenizer_dir, "tokenizer_path": tokenizer_dir,
               "context_length": 64},
        server={"port": 0, "zmq_port": 0, "log_level": "warning", "served_model_name": "tiny"},
    )


def post_in_background(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=10)))
    thread.start()
    return thread


def test_process_round_trip_drain_and_shutdown(config):
    scheduler = Receiver(endpoints.inbox(config, "scheduler"))
    launcher = Receiver(endpoints.inbox(config, "launcher"))
    to_tokenizer = Sender(endpoints.inbox(config, "tokenizer"))
    proc = TokenizerProcess(config)
    url = proc.ready_info()["http_url"]
    runner = threading.Thread(target=lambda: uvloop.run(proc.run()))
    runner.start()
    try:
        assert httpx.get(url + "/health").status_code == 503
        to_tokenizer.send(EngineReady({"page_size": 1}))
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200)

        results: list[httpx.Response] = []
        thread = post_in_background(url + "/generate", {"input_ids": [5, 6]}, results)
        request = scheduler.recv(timeout_s=5)
        assert isinstance(request, TokenizedRequest) and unpack_ids(request.input_ids) == [5, 6]
        to_tokenizer.send(TextDeltas([TextDelta(request.rid, " ok", pack_ids([9]),
                                                finish=FinishReason("stop", 9))]))  # fmt: skip
        thread.join(10)
        assert results[0].json()["text"] == " ok"
        assert results[0].json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": 9}
        assert results[0].json()["meta_info"]["prompt_tokens"] == 2  # known without the delta

        to_tokenizer.send(SchedulerStats(3, 0, 10, 100, 1.0))
        assert wait_until(lambda: httpx.get(url + "/server_info").json()["num_running"] == 3)

        thread = post_in_background(url + "/generate", {"input_ids": [7]}, results)
        held = scheduler.recv(timeout_s=5)
        to_tokenizer.send(BeginDrain(timeout_s=0.2))
        assert launcher.recv(timeout_s=5) == DrainDone(num_unfinished=1)
        assert scheduler.recv(timeout_s=5) == AbortRequest(held.rid)
        thread.join(10)
        assert results[1].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.post(url + "/generate", json={"input_ids": [7]}).status_code == 503
    finally:
        to_tokenizer.send(Shutdown("test over"))
        runner.join(10)
    assert not runner.is_alive()
    for sock in (scheduler, launcher, to_tokenizer):
        sock.close()


def test_taken_port_fails_with_a_clear_error(config):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"--port {port}"):
            TokenizerProcess(config.replace(server={"port": port}))
