"""The ZMQ ROUTER frontend's wire protocol, interleaving, and abort on client disconnect."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import zmq
import zmq.asyncio

from aerie.codec import unpack_ids
from tests.tokenizer_proc.harness import (
    LiveServer,
    dealer,
    fake_output_ids,
    make_frontend,
    recv,
    send,
    wait_until,
)
from tests.tokenizer_proc.zmq_fuzz import GOOD_BODY, pack
from tokenizer_proc.zmq_frontend import RECV_BATCH, SEND_HWM, ZmqAccess, ZmqFrontend
from tokenizer_proc.zmq_limits import ERROR_REPLIES_PER_S, ERROR_REPLY_BURST, LOG_INTERVAL_S


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


# -- limits: what a flooding client can cost ------------------------------------------------


async def inproc_frontend(tokenizer_dir: str, access=None):
    """(ZmqFrontend on inproc, a blocking DEALER on the same context, FakeEngine, Frontend), in
    the running loop. Over inproc a sent frame is in the frontend's queue at once (no I/O
    thread), so a test can queue frames before the frontend reads any."""
    frontend, engine = make_frontend(tokenizer_dir)
    context = zmq.asyncio.Context()
    zf = ZmqFrontend(frontend, f"inproc://zmq-limits-{id(frontend)}", context, access)
    client = zmq.Context.shadow(context.underlying).socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVHWM, 1)
    client.connect(zf.address)
    return zf, client, engine, frontend


def test_the_receive_loop_yields_between_batches(tokenizer_dir):
    """A steady stream of frames used to keep the loop from ever yielding (HTTP starved)."""
    num_frames = 8 * RECV_BATCH

    async def main() -> list[int]:
        zf, client, _, _ = await inproc_frontend(tokenizer_dir)
        for req_id in range(num_frames):  # aborts of nothing: no reply, no work
            client.send(pack({"op": "abort", "req_id": req_id}), zmq.NOBLOCK)
        handled: list[int] = []
        dispatch = zf._dispatch
        zf._dispatch = lambda frames: (handled.append(1), dispatch(frames))
        serve = asyncio.get_running_loop().create_task(zf.serve())
        seen = [0]  # frames handled each time another task got to run
        while len(handled) < num_frames:
            await asyncio.sleep(0)
            seen.append(len(handled))
        serve.cancel()
        client.close()
        zf.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 30))
    assert max(b - a for a, b in zip(seen, seen[1:], strict=False)) <= RECV_BATCH, seen


def test_a_connection_over_its_request_budget_gets_429(tokenizer_dir):
    frontend, engine = make_frontend(tokenizer_dir)
    engine.hold = True  # requests stay unfinished
    with LiveServer(frontend, access=ZmqAccess(max_requests_per_connection=3)) as server:
        busy, other = dealer(server.zmq_address), dealer(server.zmq_address)
        for req_id in range(4):
            body = {"input_ids": [5, req_id + 1], "stream": True}
            send(busy, {"op": "generate", "req_id": req_id, "body": body})
        replies = sorted((recv(busy) for _ in range(4)), key=lambda r: r["req_id"])
        assert [r["event"] for r in replies] == ["delta"] * 3 + ["error"]
        assert replies[3]["data"]["code"] == 429
        assert "--max-zmq-requests-per-connection" in replies[3]["data"]["message"]
        send(other, {"op": "generate", "req_id": 0, "body": {"input_ids": [6], "stream": True}})
        assert recv(other)["event"] == "delta"  # a budget per connection
        send(busy, {"op": "abort", "req_id": 0})
        assert wait_until(lambda: frontend.tracker.num_in_flight == 3)
        send(busy, {"op": "generate", "req_id": 4, "body": {"input_ids": [7], "stream": True}})
        reply = recv(busy)
        assert (reply["req_id"], reply["event"]) == (4, "delta")
        busy.close()
        other.close()


def test_a_flood_of_bad_frames_gets_few_error_replies_and_few_log_lines(live, caplog):
    """Each bad frame used to get an error reply and a log line: a million of each."""
    server, _, _ = live
    flooder = dealer(server.zmq_address)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tokenizer_proc.zmq_frontend"):
        for _ in range(5000):
            flooder.send(b"\xc1 not msgpack")
        send(flooder, {"op": "generate", "req_id": "after", "body": GOOD_BODY})
        num_errors = 0
        while (reply := recv(flooder))["req_id"] != "after":
            num_errors += reply["event"] == "error"
        elapsed = time.monotonic() - start
    assert reply["event"] == "done"  # the flooder itself is still served
    # The bound grows with the wall time measured here: a slow machine only widens it.
    assert num_errors <= ERROR_REPLY_BURST + ERROR_REPLIES_PER_S * elapsed, num_errors
    frontend_lines = [r for r in caplog.records if r.name == "tokenizer_proc.zmq_frontend"]
    assert len(frontend_lines) <= 2 + elapsed / LOG_INTERVAL_S, len(frontend_lines)
    flooder.close()


def test_unauthenticated_generates_are_refused_before_their_body_is_read(
    tokenizer_dir, monkeypatch
):
    import tokenizer_proc.zmq_frontend as zmq_frontend

    bodies_read = []
    read_body = zmq_frontend.read_body
    monkeypatch.setattr(
        zmq_frontend, "read_body", lambda *args: bodies_read.append(1) or read_body(*args)
    )
    frontend, _ = make_frontend(tokenizer_dir)
    with LiveServer(frontend, access=ZmqAccess(api_key="the-key")) as server:
        sock = dealer(server.zmq_address)
        body = {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 2}}
        for api_key in (None, "not-the-key"):
            send(sock, {"op": "generate", "req_id": 1, "body": body, "api_key": api_key})
            reply = recv(sock)
            assert reply["event"] == "error" and reply["data"]["code"] == 401
        assert bodies_read == []
        send(sock, {"op": "generate", "req_id": 2, "body": body, "api_key": "the-key"})
        assert recv(sock)["event"] == "done" and bodies_read == [1]
        sock.close()


def test_a_client_that_reads_nothing_has_its_requests_aborted(tokenizer_dir):
    """Replies to a client that reads nothing used to pile up in memory without bound."""
    num_requests = 2 * SEND_HWM // 30  # 30 replies each: more than the queue holds

    async def main() -> None:
        zf, client, engine, frontend = await inproc_frontend(tokenizer_dir)
        serve = asyncio.get_running_loop().create_task(zf.serve())
        sampling = {"max_new_tokens": 58}  # 29 deltas of 2 tokens, then "done"
        for req_id in range(num_requests):
            body = {"input_ids": [5, req_id], "sampling_params": sampling, "stream": True}
            client.send(pack({"op": "generate", "req_id": req_id, "body": body}))
        while len(engine.submitted) < num_requests or frontend.tracker.num_in_flight:
            await asyncio.sleep(0.01)
        assert engine.aborted, "no request was aborted"
        while client.poll(0):  # the client reads at last, and is served again
            client.recv()
        body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
        client.send(pack({"op": "generate", "req_id": "again", "body": body}))
        while True:
            await asyncio.sleep(0.01)
            reply = msgpack.unpackb(client.recv()) if client.poll(0) else {}
            if reply.get("req_id") == "again":
                assert reply["event"] == "done"
                break
        serve.cancel()
        client.close()
        zf.close()

    asyncio.run(asyncio.wait_for(main(), 60))
