"""Several frontends behind one port (`--tokenizer-worker-num`): connections spread over them,
and whichever one a scrape reaches reports every frontend's requests. (Every launched test
runs behind two unless it sets its own count: `tests/e2e/server.py`, AERIE_E2E_FRONTENDS.)"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2e.server import Server, child_named

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 24  # over 3 frontends: one is left out with a chance of 3 (2/3)^24 < 2e-4


def finished_requests(url: str) -> tuple[float, list[float]]:
    """aerie_requests_total over finish types, and aerie_frontend_requests_total of each
    frontend, from one scrape on a new connection."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def values(prefix: str) -> list[float]:
        return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]

    return sum(values("aerie_requests_total{")), values("aerie_frontend_requests_total{")


def test_every_frontend_takes_connections_and_reports_the_sums(tiny_model_dirs):
    args = ("--model-path", tiny_model_dirs["llama"], "--tokenizer-worker-num", "3")
    with Server(*args) as server:
        frontends = [child_named(server, f"tokenizer{i or ''}") for i in range(3)]
        assert len(set(frontends)) == 3
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
        for _ in range(NUM_REQUESTS):  # each on a new connection: the kernel picks a frontend
            response = httpx.post(server.url + "/generate", json=body, timeout=60)
            assert response.status_code == 200 and len(response.json()["output_ids"]) == 4
        # Each frontend shares its counts about once a second: soon every scrape, wherever it
        # lands, counts all of them.
        deadline = time.monotonic() + 10
        while True:
            scrapes = [finished_requests(server.url) for _ in range(8)]
            if all(total == NUM_REQUESTS for total, _ in scrapes) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [total for total, _ in scrapes] == [NUM_REQUESTS] * 8
        for _, per_frontend in scrapes:  # every frontend served some of them
            assert len(per_frontend) == 3 and sum(per_frontend) == NUM_REQUESTS
            assert min(per_frontend) > 0, per_frontend


def test_a_taken_port_stops_a_launch_with_several_frontends(tiny_model_dirs):
    """With several frontends the launcher holds the port for them: a taken one is named."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on http://127.0.0.1:{port}"):
            Server("--model-path", tiny_model_dirs["llama"], "--port", str(port))
