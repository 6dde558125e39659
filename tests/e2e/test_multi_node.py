"""Two "machines" on one: the same `launch.py --nnodes 2 --tp-size 2 --dist-init-addr ...`
command with --node-rank 0 and 1. Node 0 serves and its greedy output equals transformers';
node 1 runs worker rank 1 only and exits cleanly when node 0 stops; a node that dies takes the
other down with an error that says so."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import pytest

from aerie.resolve import free_port
from tests.e2e.reference import check_parity
from tests.e2e.server import REPO_ROOT, Server, device_args

pytestmark = pytest.mark.e2e


class WorkerNode:
    """`launch.py ... --node-rank 1`: no HTTP, so no ready URL; its log is kept."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="aerie-node1-", suffix=".log")
        cmd = [sys.executable, "launch.py", *device_args(), "--node-rank", "1", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def node_args(model_dir: str) -> list[str]:
    return [
        "--model-path",
        model_dir,
        "--nnodes",
        "2",
        "--tp-size",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{free_port()}",
    ]


def test_two_nodes_serve_and_node_one_follows_node_zero_down(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    args = node_args(path)
    node1 = WorkerNode(*args)
    try:
        with Server(*args, "--chunked-prefill-size", "16") as node0:
            check_parity(path, node0.url, vocab=320, seed=17)
            assert "Aerie node 1 of 2 is ready: tensor-parallel ranks 1..1" in node1.text()
            assert node0.stop() == 0
        assert node1.wait(timeout_s=20) == 0, node1.text()
        assert "node 0 stopped the server" in node1.text()
    finally:
        node1.kill()


def test_a_node_that_dies_stops_the_other(tiny_model_dirs):
    args = node_args(tiny_model_dirs["llama"])
    node1 = WorkerNode(*args)
    try:
        with Server(*args) as node0:
            node0.proc.send_signal(signal.SIGKILL)  # node 0's launcher: its children follow
            start = time.monotonic()
            assert node1.wait(timeout_s=30) == 1, node1.text()
            assert time.monotonic() - start < 15
            assert "tensor-parallel rank 0 (node 0, 127.0.0.1:" in node1.text()
            assert "is gone" in node1.text()
    finally:
        node1.kill()
