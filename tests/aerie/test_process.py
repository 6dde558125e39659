"""A process's liveness: the loop's Progress record, and the heartbeat thread that reports it
while the loop is busy."""

from __future__ import annotations

import time

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.messages import Heartbeat, HeartbeatAck
from aerie.process import HeartbeatThread, Progress
from aerie.transport import Receiver, Sender


def test_progress_moves_on_every_begin_advance_and_end():
    progress = Progress(describe=lambda what: f"step {what}")
    assert progress.snapshot() == ("", 0.0, 0)
    progress.begin(7, since=time.monotonic() - 5.0)
    doing, busy_s, count = progress.snapshot()
    assert doing == "step 7" and 5.0 <= busy_s < 60.0 and count == 1
    progress.advance()
    assert progress.snapshot()[0] == "step 7" and progress.snapshot()[2] == 2
    progress.end()
    assert progress.snapshot() == ("", 0.0, 3)


def test_the_heartbeat_thread_answers_while_the_loop_computes_in_python(tmp_path):
    """The loop holds the GIL in a pure-Python computation (as under TRITON_INTERPRET) and
    never reads a socket: heartbeats are still answered, with what it is doing."""
    config = AerieConfig(runtime_dir=str(tmp_path))
    progress = Progress()
    thread = HeartbeatThread(config, "scheduler", progress)
    launcher = Receiver(endpoints.inbox(config, "launcher"))
    to_thread = Sender(endpoints.heartbeat(config, "scheduler"))
    thread.start()
    try:
        progress.begin("a long computation")
        to_thread.send(Heartbeat(seq=1))
        ack, total, deadline = None, 0, time.monotonic() + 60
        while ack is None and time.monotonic() < deadline:
            for i in range(100_000):  # pure Python: the thread runs only at GIL switches
                total += i * i
            ack = launcher.recv(timeout_s=0)
        assert isinstance(ack, HeartbeatAck)
        assert (ack.name, ack.seq, ack.doing) == ("scheduler", 1, "a long computation")
        assert ack.busy_s > 0 and ack.progress == 1
    finally:
        thread.stop()
        to_thread.close()
        launcher.close()
    assert not thread.is_alive()
