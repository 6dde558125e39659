from __future__ import annotations

import asyncio
import threading
import time

from aerie.messages import AbortRequest, Shutdown
from aerie.transport import AsyncReceiver, AsyncSender, Receiver, Sender


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
    inbox, out = Receiver(address), Sender(address)
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
    inbox.close()


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
