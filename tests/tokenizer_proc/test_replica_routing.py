"""The frontend's backend over several data-parallel replicas: each new request goes to the
replica with the fewest unfinished requests, its abort to the replica it went to, and a
finished request frees its place."""

from __future__ import annotations

import asyncio

from aerie.messages import AbortRequest, SamplingParams, TokenizedRequest
from tokenizer_proc.process import SchedulerBackend


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, message: object) -> None:
        self.sent.append(message)


def request(rid: str) -> TokenizedRequest:
    return TokenizedRequest(rid, b"", SamplingParams(), False, False)


def test_requests_go_to_the_least_loaded_replica_and_aborts_follow_them():
    senders = [FakeSender(), FakeSender()]
    backend = SchedulerBackend(senders)

    async def run() -> None:
        for rid in ("a", "b", "c"):
            await backend.submit(request(rid))  # a -> 0, b -> 1, c -> 0
        assert backend.load == [2, 1]
        backend.finished("a")  # replica 0 frees a place: the next goes to either; ties -> 0
        backend.finished("b")
        assert backend.load == [1, 0]
        await backend.submit(request("d"))  # -> 1, the emptier one
        await backend.abort("c")  # to replica 0, where c went
        await backend.abort("d")  # to replica 1
        backend.finished("c")
        backend.finished("d")
        backend.finished("d")  # twice is harmless

    asyncio.run(run())
    rids = [[m.rid for m in s.sent if isinstance(m, TokenizedRequest)] for s in senders]
    assert rids == [["a", "c"], ["b", "d"]]
    aborts = [[m.rid for m in s.sent if isinstance(m, AbortRequest)] for s in senders]
    assert aborts == [["c"], ["d"]]
    assert backend.load == [0, 0]
