"""`--dp-size 2` on a launched CPU server: two scheduler + worker replicas behind one frontend.
Greedy output equals transformers' with the requests spread over both replicas, and
/server_info and /metrics report each replica. (Which replica a request goes to and where its
abort follows it: tests/tokenizer_proc/test_replica_routing.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.reference import check_parity
from tests.e2e.server import Server, child_named

pytestmark = pytest.mark.e2e


def test_two_replicas_serve_at_once_and_match_transformers(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    with Server("--model-path", path, "--dp-size", "2", "--chunked-prefill-size", "16") as server:
        child_named(server, "dp1_scheduler")
        child_named(server, "dp1_worker")
        check_parity(path, server.url, vocab=320, seed=13)
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        served = [replica["num_requests"] for replica in info["replicas"]]
        assert min(served) > 0 and sum(served) == info["num_requests"] == 16, served
        assert info["dp_size"] == 2 and info["kv_used_tokens"] == 0
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'aerie_replica_kv_cache_usage{replica="1"} 0.0' in metrics
        assert server.stop() == 0
