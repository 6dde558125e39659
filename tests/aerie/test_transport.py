from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aerie.codec import pack_ids
from aerie.messages import AbortRequest, ForwardPlan, Shutdown
from aerie.transport import AsyncReceiver, AsyncSender, Inbox, Receiver, Sender, StepLink


def test_push_pull_round_trip_and_drain(tmp_path):
    address = f"ipc://{tmp_path}/inbox.sock"
    inbox = Receiver(address)
    out = Sender(address)
    assert inbox.recv(timeout_s=0.01) is None
    out.send(AbortRequest("a"))
    out.send(Shutdown("bye"))
    assert inbox.recv(timeout_s=2) == AbortRequest("a")
    assert inbox.recv(timeout_s=2) == Shutdown("bye")
    for i in range(5):
        out.send(AbortRequest(str(i)))
    received = []
    while len(received) < 5:
        received += inbox.drain()
    assert [m.rid for m in received] == ["0", "1", "2", "3", "4"]
    out.close()
    inbox.close()


def test_spinning_recv_gets_a_message_sent_during_the_spin_and_then_still_waits(tmp_path):
    address = f"ipc://{tmp_path}/spin.sock"
    receiver, out = Receiver(address), Sender(address)
    inbox = Inbox(receiver)
    start = time.perf_counter()
    assert inbox.recv(timeout_s=0.05, spin_s=0.02) is None  # nothing: spins, then blocks
    assert time.perf_counter() - start >= 0.045
    timer = threading.Timer(0.01, out.send, [AbortRequest("during")])
    timer.start()
    assert inbox.recv(timeout_s=2, spin_s=1.0) == AbortRequest("during")
    timer = threading.Timer(0.05, out.send, [AbortRequest("after")])  # after the spin
    timer.start()
    assert inbox.recv(timeout_s=2, spin_s=0.01) == AbortRequest("after")
    out.close()
    receiver.close()


def test_async_pair(tmp_path):
    address = f"ipc://{tmp_path}/async.sock"

    async def main():
        inbox = AsyncReceiver(address)
        out = AsyncSender(address)
        await out.send(AbortRequest("x"))
        got = await asyncio.wait_for(inbox.recv(), 2)
        out.close()
        inbox.close()
        return got

    assert asyncio.run(main()) == AbortRequest("x")


def test_step_link_carries_both_ways_in_order_and_whole(tmp_path):
    """Messages cross the link in order in both directions, one far larger than a socket read
    (a long prompt's plan) arrives whole, a half-received one is not handed out, and the
    worker's end accepts the scheduler when it connects."""
    path = str(tmp_path / "gpu_worker.link")
    worker = StepLink.listen(path)
    scheduler = StepLink.connect(path, timeout_s=2)
    assert worker.try_recv() is None and worker.connected  # the accept
    big = ForwardPlan(
        plan_id=1, mode="extend", rows=pack_ids([1]), input_ids=pack_ids(list(range(700_000)))
    )
    sender = threading.Thread(
        target=lambda: [scheduler.send(m) for m in (big, AbortRequest("x"), Shutdown("s"))]
    )
    sender.start()
    received = []
    deadline = time.monotonic() + 10
    while len(received) < 3 and time.monotonic() < deadline:
        received += Inbox(worker).drain()
    sender.join()
    assert received == [big, AbortRequest("x"), Shutdown("s")]
    worker.send(AbortRequest("back"))
    assert Inbox(scheduler).recv(timeout_s=2) == AbortRequest("back")
    # A message whose bytes have only partly arrived stays in the buffer.
    data = StepLink.HEADER.pack(100) + b"x" * 10
    scheduler._conn.sendall(data)
    assert Inbox(worker).recv(timeout_s=0.05) is None
    scheduler.close()
    worker.close()


def test_a_closed_link_stops_receiving_and_refuses_sends(tmp_path):
    path = str(tmp_path / "gpu_worker.link")
    worker = StepLink.listen(path)
    scheduler = StepLink.connect(path, timeout_s=2)
    inbox = Receiver(f"ipc://{tmp_path}/inbox.sock")
    both = Inbox(worker, inbox)
    assert both.recv(timeout_s=0.05) is None and worker.connected
    scheduler.close()
    assert both.recv(timeout_s=0.2) is None  # the peer's end is closed: nothing, no error
    assert worker.closed and worker.poll_target() is None
    Sender(f"ipc://{tmp_path}/inbox.sock").send(Shutdown("zmq still works"))
    assert both.recv(timeout_s=2) == Shutdown("zmq still works")
    with pytest.raises(ConnectionError):
        worker.send(AbortRequest("nobody"))
    with pytest.raises(ConnectionError, match="no GPU worker listens"):
        StepLink.connect(str(tmp_path / "nobody.link"), timeout_s=0.05)
    inbox.close()


def test_inbox_waits_on_every_source_until_the_timeout(tmp_path):
    """A blocking wait wakes for a message on either source; with nothing it returns None
    after about the timeout."""
    path = str(tmp_path / "gpu_worker.link")
    worker = StepLink.listen(path)
    inbox = Receiver(f"ipc://{tmp_path}/inbox.sock")
    both = Inbox(worker, inbox)
    scheduler = StepLink.connect(path, timeout_s=2)
    timer = threading.Timer(0.1, lambda: scheduler.send(AbortRequest("late")))
    timer.start()
    start = time.monotonic()
    assert both.recv(timeout_s=5) == AbortRequest("late")  # accepted, then read, while waiting
    assert time.monotonic() - start < 4
    start = time.monotonic()
    assert both.recv(timeout_s=0.2) is None
    assert 0.15 < time.monotonic() - start < 2
    timer.join()
    scheduler.close()
    worker.close()
    inbox.close()
