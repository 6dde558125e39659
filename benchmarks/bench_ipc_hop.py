"""One hop between two processes: what a scheduler-worker message costs on the way, by transport.

    python3 benchmarks/bench_ipc_hop.py --messages 3000 --size 96

Two processes ping-pong a message, spinning or blocking, over ZMQ PUSH/PULL (as
`aerie.transport`) and over a plain Unix stream socket; printed: one-way time, median and p99.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import time

import zmq

HEADER = struct.Struct("<I")


class ZmqPeer:
    def __init__(self, inbox: str, outbox: str) -> None:
        context = zmq.Context.instance()
        self.pull = context.socket(zmq.PULL)
        self.pull.bind(inbox)
        self.push = context.socket(zmq.PUSH)
        self.push.connect(outbox)

    def send(self, data: bytes) -> None:
        self.push.send(data, copy=False)

    def recv(self, spin: bool) -> bytes:
        if not spin:
            return self.pull.recv()
        while True:
            try:
                return self.pull.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                pass


class UnixPeer:
    """One end of a connected Unix stream socket; messages framed by a 4-byte length."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(data)) + data)

    def recv(self, spin: bool) -> bytes:
        self.sock.setblocking(not spin)
        while True:
            if len(self.buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(self.buffer)
                if len(self.buffer) >= HEADER.size + size:
                    data = bytes(self.buffer[HEADER.size : HEADER.size + size])
                    del self.buffer[: HEADER.size + size]
                    return data
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise ConnectionError("peer closed")
            self.buffer += chunk


def make_peer(kind: str, side: int, directory: str) -> ZmqPeer | UnixPeer:
    if kind == "zmq":
        a, b = f"ipc://{directory}/a", f"ipc://{directory}/b"
        return ZmqPeer(a, b) if side == 0 else ZmqPeer(b, a)
    path = os.path.join(directory, "unix")
    if side == 0:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        conn, _ = server.accept()
        return UnixPeer(conn)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(1000):
        try:
            client.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.005)
    return UnixPeer(client)


def echo(kind: str, spin: bool, directory: str, messages: int) -> None:
    peer = make_peer(kind, 1, directory)
    for _ in range(messages):
        peer.send(peer.recv(spin))


def measure(kind: str, spin: bool, messages: int, size: int) -> list[float]:
    """One-way times in microseconds (half of each round trip), after a warm-up."""
    directory = tempfile.mkdtemp()
    other = mp.get_context("spawn").Process(target=echo, args=(kind, spin, directory, messages))
    other.start()
    peer = make_peer(kind, 0, directory)
    if kind == "zmq":
        time.sleep(0.3)  # both connects done before the first message
    payload = os.urandom(size)
    times = []
    for i in range(messages):
        start = time.perf_counter()
        peer.send(payload)
        peer.recv(spin)
        if i >= messages // 10:
            times.append((time.perf_counter() - start) / 2 * 1e6)
    other.join()
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--size", type=int, default=96, help="bytes per message")
    args = p.parse_args(argv)
    print(f"{'transport':10s} {'wait':8s} {'median us':>10s} {'p99 us':>8s}")
    for kind in ("zmq", "unix"):
        for spin in (True, False):
            times = sorted(measure(kind, spin, args.messages, args.size))
            p99 = times[int(0.99 * (len(times) - 1))]
            print(
                f"{kind:10s} {'spin' if spin else 'block':8s} {statistics.median(times):10.1f} "
                f"{p99:8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
