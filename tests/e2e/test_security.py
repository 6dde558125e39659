"""A launched server with a key, used as a user would: the official `openai` client and our ZMQ
client with and without the key, and the refusal to listen beyond loopback without one."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from aerie.client import AerieClientError, Client
from tests.e2e.server import REPO_ROOT, Server

pytestmark = pytest.mark.e2e

KEY = "e2e-key-7f3a"  # from $AERIE_API_KEY, as the systemd unit's environment file sets it
GREEDY_3 = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dirs):
    with Server("--model-path", tiny_model_dirs["llama"], env={"AERIE_API_KEY": KEY}) as server:
        yield server


def test_the_openai_client_needs_the_key(keyed_server):
    with_key = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, timeout=60)
    model = with_key.models.list().data[0].id
    r = with_key.completions.create(model=model, prompt="ab", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    wrong = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="not-it", timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model, prompt="ab", max_tokens=4)
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key


def test_the_zmq_client_needs_the_key(keyed_server):
    with Client(keyed_server.zmq_address, api_key=KEY) as client:
        out = client.generate(input_ids=[5, 6, 7], sampling_params=GREEDY_3)
        assert len(out["output_ids"]) == 3
    with Client(keyed_server.zmq_address) as client:
        with pytest.raises(AerieClientError) as error:
            client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    assert error.value.code == 401 and "api_key" in str(error.value)


def test_the_key_never_appears_in_logs_or_responses(keyed_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(keyed_server.url + "/server_info", headers=headers).text
    metrics = httpx.get(keyed_server.url + "/metrics", headers=headers).text
    assert KEY not in info and KEY not in metrics and '"api_key_set":true' in info
    assert KEY not in keyed_server.log_text()


def test_beyond_loopback_without_a_key_is_refused_with_the_way_out(tiny_model_dirs):
    result = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--device",
            "cpu",
            "--host",
            "0.0.0.0",
            "--model-path",
            tiny_model_dirs["llama"],
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "AERIE_API_KEY"},
    )
    assert result.returncode == 2
    assert "--api-key" in result.stderr and "--allow-unauthenticated" in result.stderr
