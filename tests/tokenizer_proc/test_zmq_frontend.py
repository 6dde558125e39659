"""The ZMQ ROUTER frontend's wire protocol, interleaving, and abort on client disconnect."""

from __future__ import annotations

from aerie.codec import unpack_ids
from tests.tokenizer_proc.harness import dealer, fake_output_ids, recv, send, wait_until


def test_generate_and_stream_events(live):
    server, _, engine = live
    sock = dealer(server.zmq_address)
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 5}, "stream": True}
    send(sock, {"op": "generate", "req_id": 7, "body": body})
    replies = []
    while not replies or replies[-1]["event"] != "done":
        replies.append(recv(sock))
    expected = fake_output_ids(engine.submitted[0])
    deltas = [r["data"] for r in replies[:-1]]
    assert all(r["req_id"] == 7 for r in replies)
    assert [i for d in deltas for i in d["output_ids"]] == expected  # incremental
    assert replies[-1]["data"]["output_ids"] == expected  # the /generate dict
    assert deltas[-1]["meta_info"]["finish_reason"]["type"] == "length"
    sock.close()


def test_errors_come_back_with_the_req_id(live):
    server, frontend, engine = live
    sock = dealer(server.zmq_address)
    send(sock, {"op": "generate", "req_id": "a", "body": {"text": ""}})
    reply = recv(sock)
    assert reply["req_id"] == "a" and reply["event"] == "error" and reply["data"]["code"] == 400
    send(sock, {"op": "dance", "req_id": "b"})
    assert recv(sock)["event"] == "error"
    sock.send(b"\xc1 not msgpack")
    assert recv(sock)["event"] == "error"
    frontend.begin_drain()
    send(sock, {"op": "generate", "req_id": "c", "body": {"input_ids": [1]}})
    assert recv(sock)["data"]["code"] == 503
    assert engine.submitted == []
    sock.close()


def test_many_clients_interleave(live):
    server, _, engine = live
    socks = [dealer(server.zmq_address) for _ in range(3)]
    for n, sock in enumerate(socks):
        for req_id in range(2):
            body = {"input_ids": [10 + n, req_id + 1], "sampling_params": {"max_new_tokens": 3}}
            send(sock, {"op": "generate", "req_id": req_id, "body": body})
    by_rid = {}
    for sock in socks:
        replies = sorted((recv(sock) for _ in range(2)), key=lambda r: r["req_id"])
        for req_id, reply in enumerate(replies):
            assert reply["event"] == "done" and reply["req_id"] == req_id
            by_rid[reply["data"]["meta_info"]["id"]] = reply["data"]["output_ids"]
        sock.close()
    assert len(by_rid) == 6
    assert all(by_rid[r.rid] == fake_output_ids(r) for r in engine.submitted)


def test_disconnected_client_has_its_requests_aborted(live):
    server, frontend, engine = live
    engine.hold = True
    gone, staying = dealer(server.zmq_address), dealer(server.zmq_address)
    send(gone, {"op": "generate", "req_id": 1, "body": {"input_ids": [5]}})
    send(staying, {"op": "generate", "req_id": 1, "body": {"input_ids": [6]}})
    assert wait_until(lambda: len(engine.submitted) == 2)
    gone.close()
    rid_gone = next(r.rid for r in engine.submitted if unpack_ids(r.input_ids) == [5])
    assert wait_until(lambda: engine.aborted == [rid_gone])
    assert frontend.tracker.num_in_flight == 1  # the other client's request is untouched
    send(staying, {"op": "abort", "req_id": 1})
    assert wait_until(lambda: len(engine.aborted) == 2)
    staying.close()


def test_abort_storm_through_async_client_applies_every_abort(live):
    """96 streams left after their first delta: every request is aborted in the engine (the
    launched-server storm in tests/e2e/test_robustness.py exercises the socket race)."""
    import asyncio

    from aerie.client import AsyncClient

    server, frontend, engine = live
    engine.delay_s = 0.02  # ~30 deltas per request: replies flow while the aborts arrive
    sampling = {"max_new_tokens": 60}

    async def storm() -> None:
        client = AsyncClient(server.zmq_address)

        async def leave_early(i: int) -> None:
            async for _ in client.stream(input_ids=[5, i + 1], sampling_params=sampling):
                break

        await asyncio.gather(*(leave_early(i) for i in range(96)))
        await asyncio.sleep(0)  # let the closed streams send their aborts
        client.close()

    asyncio.run(storm())
    assert wait_until(lambda: len(engine.aborted) == 96, timeout_s=10), len(engine.aborted)
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.submitted)
    assert frontend.tracker.num_in_flight == 0



def test_rids_in_bodies_are_scoped_per_connection(live):
    server, _, engine = live
    engine.hold = True
    first, second = dealer(server.zmq_address), dealer(server.zmq_address)
    body = {"input_ids": [5], "rid": "same", "stream": True}
    send(first, {"op": "generate", "req_id": 1, "body": body})
    assert recv(first)["event"] == "delta"
    send(first, {"op": "generate", "req_id": 2, "body": body})  # same connection: refused
    reply = recv(first)
    assert reply["event"] == "error" and reply["req_id"] == 2 and reply["data"]["param"] == "rid"
    send(second, {"op": "generate", "req_id": 1, "body": body})  # another client: its own rid
    delta = recv(second)
    assert delta["event"] == "delta" and delta["data"]["meta_info"]["id"] == "same"
    assert len(engine.submitted) == 2 and engine.submitted[0].rid != engine.submitted[1].rid
    first.close()
    second.close()
