"""Test harness: a fake engine that plays the scheduler, and a live server thread.

`FakeEngine` is the Frontend's backend: each submitted request gets
`fake_output_ids(request)` back in steps of `tokens_per_delta` tokens (one StepOutputs each),
logprob -0.5 per token, one verify per step and finish "length". The frontend made by
`make_frontend` shows ids as `fake_text(ids)` (`FakeDetokenizer`: the real incremental
detokenizer has its own tests). With `hold = True` a request gets one step and never finishes
(for disconnect and drain tests).
`LiveServer` runs uvicorn and the ZMQ frontend on one asyncio loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass, field

import msgpack
import uvloop
import zmq
import zmq.asyncio

from aerie.codec import pack_floats, pack_ids, unpack_ids
from aerie.messages import FinishReason, TokenizedRequest
from aerie.outputs import OutputsWriter, RequestOutput
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http_api import create_app
from tokenizer_proc.http_guard import GuardPolicy, edge_protocol
from tokenizer_proc.process import _Server
from tokenizer_proc.request_tracker import RequestState
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import Limits
from tokenizer_proc.zmq_frontend import ZmqAccess, ZmqFrontend

CONTEXT_LENGTH = 64
LOGPROB = -0.5


def fake_output_ids(request: TokenizedRequest) -> list[int]:
    prompt = unpack_ids(request.input_ids)
    return [(prompt[-1] + 7 * k + 1) % 200 + 10 for k in range(request.sampling.max_new_tokens)]


def fake_text(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


class FakeDetokenizer:
    """A request's text as `fake_text` makes it, token by token."""

    def step(self, ids: list[int], finish: FinishReason | None = None) -> str:
        return fake_text(ids)


@dataclass
class Out:
    """One request's output of a step and the text its detokenizer makes of it, for tests
    that drive a `RequestState` directly (`apply_output`)."""

    text: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    spec_verify_ct: int = 0


class _TextIs:
    def __init__(self, text: str) -> None:
        self.text = text

    def step(self, ids: list[int], finish: FinishReason | None = None) -> str:
        return self.text


def apply_output(state: RequestState, out: Out) -> None:
    """Apply `out` to state as the tracker would, its detokenizer answering `out.text`."""
    state.detokenizer = _TextIs(out.text)
    ids, logprobs = list(out.ids), list(out.logprobs)  # fresh lists, as the tracker's are
    output = RequestOutput(state.rid, ids, logprobs, out.spec_verify_ct, 0, out.finish)
    state._apply(output)


class FakeEngine:
    def __init__(self, tokens_per_delta: int = 2) -> None:
        self.frontend: Frontend | None = None
        self.tokens_per_delta = tokens_per_delta
        self.delay_s = 0.0  # between deltas, to keep many streams going at once
        self.hold = False
        self.submitted: list[TokenizedRequest] = []
        self.aborted: list[str] = []

    async def submit(self, request: TokenizedRequest) -> None:
        self.submitted.append(request)
        asyncio.get_running_loop().create_task(self.play(request))

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def finished(self, rid: str) -> None:
        pass

    async def describe(self, flush_cache: bool = False) -> list[dict]:
        """One scheduler that holds every submitted request still in flight."""
        held = [{"rid": r.rid} for r in self.submitted if r.rid in self.frontend.tracker]
        return [{"replica": 0, "answered": True, "requests": held}]

    async def play(self, request: TokenizedRequest) -> None:
        ids = fake_output_ids(request)
        step = self.tokens_per_delta
        for num_verify, start in enumerate(range(0, len(ids), step), start=1):
            await asyncio.sleep(self.delay_s)
            if request.rid not in self.frontend.tracker:
                return  # aborted
            chunk = ids[start : start + step]
            done = start + step >= len(ids) and not self.hold
            writer = OutputsWriter()
            logprobs = pack_floats([LOGPROB] * len(chunk)) if request.return_logprob else None
            finish = FinishReason("length") if done else None
            writer.add(0, request.rid, pack_ids(chunk), num_verify, 0, logprobs, finish)
            for message in writer.take():
                self.frontend.tracker.feed(message)
            if self.hold:
                return


def make_frontend(
    tokenizer_dir: str, ready: bool = True, random_seed: int = 0, index: int = 0
) -> tuple[Frontend, FakeEngine]:
    tokenizer = Tokenizer(tokenizer_dir)
    engine = FakeEngine()
    limits = Limits(vocab_size=tokenizer.vocab_size, context_length=CONTEXT_LENGTH)
    frontend = Frontend(tokenizer, limits, engine, "/models/tiny-model", random_seed, index)
    tokenizer.detokenizer = lambda sampling, stream, prompt_ids: FakeDetokenizer()
    engine.frontend = frontend
    if ready:
        frontend.mark_ready({"page_size": 1, "max_total_tokens": 1000})
    return frontend, engine


class LiveServer:
    """uvicorn on an ephemeral port + the ZMQ frontend, on one loop in a background thread."""

    def __init__(
        self,
        frontend: Frontend,
        policy: GuardPolicy | None = None,
        access: ZmqAccess | None = None,
        header_timeout_s: float = 10.0,
        max_connections: int | None = None,
        slow_client_timeout_s: float | None = None,
    ) -> None:
        """policy / access / header_timeout_s / max_connections / slow_client_timeout_s: the
        HTTP and ZMQ edge settings the real process derives from its config (defaults: open)."""
        self.frontend = frontend
        self.access = access
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.zmq_address = ""
        self.zmq: ZmqFrontend | None = None
        self.zmq_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        protocol = edge_protocol(header_timeout_s, max_connections, slow_client_timeout_s)
        config = _uvicorn_config(create_app(frontend, policy), protocol)
        self._server = _Server(config)
        self._thread = threading.Thread(target=lambda: uvloop.run(self._main()), daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("test server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        context = zmq.asyncio.Context()
        self.zmq = ZmqFrontend(self.frontend, "tcp://127.0.0.1:*", context, self.access)
        self.zmq_address = self.zmq.address
        http = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        self.zmq_task = asyncio.create_task(self.zmq.serve())
        while not self._server.started and not http.done():
            await asyncio.sleep(0.005)
        self._started.set()
        await http
        self.zmq_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.zmq_task
        self.zmq.close()
        context.term()


def _uvicorn_config(app, protocol):
    import uvicorn

    return uvicorn.Config(
        app,
        log_config=None,
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=1,
        http=protocol,
    )


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Poll predicate until true (for effects that cross threads); False on timeout."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: dict) -> None:
    sock.send(msgpack.packb(msg))


def recv(sock: zmq.Socket) -> dict:
    while True:
        reply = msgpack.unpackb(sock.recv())
        if reply["event"] != "ping":
            return reply
