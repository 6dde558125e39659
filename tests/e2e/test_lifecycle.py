"""Process supervision: a dead child stops everything; SIGTERM drains running requests."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import Server, pid_alive

pytestmark = pytest.mark.e2e


def _tiny_args(tiny_model_dirs) -> tuple[str, ...]:
    return ("--model-path", tiny_model_dirs["llama"])


def _child_named(server: Server, name: str) -> int:
    """The pid of child `name`: children name themselves `aerie-<name>` (15 bytes at most)."""
    for pid in server.children:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == f"aerie-{name}"[:15]:
                return pid
    raise AssertionError(f"no child for {name}: {server.children}")


@pytest.mark.parametrize("victim", ["tokenizer", "scheduler", "gpu_worker", "detokenizer"])
def test_killing_a_child_stops_everything(tiny_model_dirs, victim):
    with Server(*_tiny_args(tiny_model_dirs)) as server:
        os.kill(_child_named(server, victim), signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=15)
        assert time.monotonic() - start < 10
        assert code != 0
        time.sleep(0.5)
        assert not [p for p in server.children if pid_alive(p)], "orphaned children"
        assert victim in server.log_text()


def test_sigterm_drains_running_requests(tiny_model_dirs):
    with Server(*_tiny_args(tiny_model_dirs), "--drain-timeout-s", "60") as server:
        results = {}

        def long_request():
            body = {"input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
            results["long"] = httpx.post(server.url + "/generate", json=body, timeout=120)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(server.url + "/generate", json={"input_ids": [5]}, timeout=30)
        assert late.status_code == 503
        thread.join(120)
        assert results["long"].status_code == 200
        assert results["long"].json()["meta_info"]["completion_tokens"] == 300
        assert server.proc.wait(timeout=30) == 0
        assert not [p for p in server.children if pid_alive(p)]
