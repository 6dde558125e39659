"""aerie.client (Client, AsyncClient) against the tokenizer's ZMQ frontend with a fake engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from aerie.client import AerieClientError, AerieTimeoutError, AsyncClient, Client
from tests.tokenizer_fixture import make_tiny_tokenizer
from tests.tokenizer_proc.harness import (
    LOGPROB,
    LiveServer,
    fake_output_ids,
    fake_text,
    make_frontend,
    wait_until,
)

GREEDY = {"max_new_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("client_tokenizer"))


@pytest.fixture
def live(tokenizer_dir):
    frontend, engine = make_frontend(tokenizer_dir)
    with LiveServer(frontend) as server:
        yield server, frontend, engine


def test_generate_returns_the_generate_dict(live):
    server, _, engine = live
    with Client(server.zmq_address) as client:
        out = client.generate(text="Hello world", sampling_params=GREEDY, return_logprob=True)
        batch = client.generate(input_ids=[[5], [6, 7]], sampling_params=GREEDY, rid=["a", "b"])
    expected = fake_output_ids(engine.submitted[0])
    assert out["output_ids"] == expected and out["text"] == fake_text(expected)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["output_token_logprobs"][0] == [LOGPROB, expected[0], None]
    assert [o["meta_info"]["id"] for o in batch] == ["a", "b"]


def test_stream_yields_incremental_deltas(live):
    server, _, engine = live
    with Client(server.zmq_address) as client:
        deltas = list(client.stream(input_ids=[5, 6], sampling_params=GREEDY))
    expected = fake_output_ids(engine.submitted[0])
    assert "".join(d["text"] for d in deltas) == fake_text(expected)
    assert [i for d in deltas for i in d["output_ids"]] == expected
    assert deltas[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_server_errors_raise(live):
    server, frontend, _ = live
    with Client(server.zmq_address) as client:
        with pytest.raises(AerieClientError) as info:
            client.generate(input_ids=[1, 10**9])
        assert info.value.code == 400 and "vocabulary" in info.value.message
        frontend.begin_drain()
        with pytest.raises(AerieClientError) as info:
            client.generate(text="hi")
        assert info.value.code == 503
    with pytest.raises(ValueError):
        Client(server.zmq_address).generate()


def test_timeout_and_early_stream_exit_abort(live):
    server, _, engine = live
    engine.hold = True
    with Client(server.zmq_address) as client:
        with pytest.raises(AerieTimeoutError):
            client.generate(input_ids=[5], timeout=0.2)
        assert wait_until(lambda: len(engine.aborted) == 1)
        stream = client.stream(input_ids=[6])
        next(stream)
        stream.close()
        assert wait_until(lambda: len(engine.aborted) == 2)
    assert engine.aborted == [r.rid for r in engine.submitted]


def test_async_timeout_and_early_stream_exit_abort(live):
    server, _, engine = live
    engine.hold = True

    async def run():
        async with AsyncClient(server.zmq_address) as client:
            with pytest.raises(AerieTimeoutError):
                await client.generate(input_ids=[5], timeout=0.2)
            stream = client.stream(input_ids=[6])
            await stream.__anext__()
            await stream.aclose()
            await asyncio.sleep(0)

    asyncio.run(run())
    assert wait_until(lambda: len(engine.aborted) == 2)
    assert engine.aborted == [r.rid for r in engine.submitted]


def test_async_client_interleaves_requests(live):
    server, _, engine = live

    async def run():
        async with AsyncClient(server.zmq_address) as client:
            outs = await asyncio.gather(
                *(client.generate(input_ids=[5 + i], sampling_params=GREEDY) for i in range(4))
            )
            deltas = [d async for d in client.stream(input_ids=[9], sampling_params=GREEDY)]
            with pytest.raises(AerieClientError):
                await client.generate(text="")
        return outs, deltas

    outs, deltas = asyncio.run(run())
    by_rid = {r.rid: r for r in engine.submitted}
    assert len(outs) == 4
    assert all(o["output_ids"] == fake_output_ids(by_rid[o["meta_info"]["id"]]) for o in outs)
    assert [i for d in deltas for i in d["output_ids"]] == fake_output_ids(engine.submitted[-1])


def test_async_close_works_with_or_without_await(live):
    server, _, _ = live

    async def run():
        client = AsyncClient(server.zmq_address)
        await client.generate(input_ids=[5], sampling_params=GREEDY)
        client.close()
        other = AsyncClient(server.zmq_address)
        await other.close()

    asyncio.run(run())


def test_client_imports_nothing_heavy():
    code = (
        "import sys, aerie.client; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert out.stdout.strip() == "False"
