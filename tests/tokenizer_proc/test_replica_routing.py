"""The frontend's backend over several data-parallel replicas: each new request goes to the
replica with the fewest unfinished requests, its abort to the replica it went to, and a
finished request frees its place."""

from __future__ import annotations

import asyncio

from aerie.messages import AbortRequest, SamplingParams, TokenizedRequest
from tests.tokenizer_proc.harness import make_frontend
from tokenizer_proc.frontend import Prepared
from tokenizer_proc.process import SchedulerBackend


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, message: object) -> None:
        self.sent.append(message)


def request(rid: str) -> TokenizedRequest:
    return TokenizedRequest(rid, b"", SamplingParams())


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


def test_a_frontend_abort_reaches_the_replica_its_request_went_to(tokenizer_dir):
    """The frontend drops an aborted request locally (which frees its place in the router), so
    the abort must be routed before that."""
    frontend, _ = make_frontend(tokenizer_dir)
    senders = [FakeSender(), FakeSender()]
    frontend.backend = backend = SchedulerBackend(senders)

    async def run() -> None:
        prepared = [Prepared(f"r{i}", [5, 6], SamplingParams()) for i in range(2)]
        await frontend.submit(prepared, stream=False, return_logprob=False)  # r0 -> 0, r1 -> 1
        frontend.abort("r1")
        await asyncio.sleep(0)  # the abort is sent in the background

    asyncio.run(run())
    assert [m.rid for m in senders[1].sent if isinstance(m, AbortRequest)] == ["r1"]
    assert not any(isinstance(m, AbortRequest) for m in senders[0].sent)
    assert backend.load == [1, 0]
