"""Delivery-path benchmark: what streaming events to HTTP clients costs the tokenizer process,
on the CPU, with no model and no GPU.

    python3 benchmarks/bench_delivery.py --streams 64 --step-ms 1.35 --output-len 256

The tokenizer's own app serves; a feeder process sends one token per running stream every
--step-ms, as the scheduler would (one `StepOutputs` a step). The tokenizer process detokenizes
the ids itself, so the server CPU per event includes detokenization (a request's
`IncrementalDetokenizer`, a token at a time). The served tokenizer is a small byte-level BPE
trained at start (`--tokenizer DIR`: a model's), and each stream's ids are `TEXT` encoded by it,
so they decode to text, multi-byte characters split across tokens included. Reported: events/s,
tokens per event, ITL, and CPU per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import uvicorn
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.codec import pack_floats, pack_ids  # noqa: E402
from aerie.endpoints import http_socket  # noqa: E402
from aerie.hf_tokenizer import load_hf_tokenizer  # noqa: E402
from aerie.messages import AbortRequest, FinishReason, Shutdown, TokenizedRequest  # noqa: E402
from aerie.outputs import OutputsWriter  # noqa: E402
from aerie.transport import AsyncReceiver, AsyncSender, Receiver, Sender  # noqa: E402
from benchmarks.bench_serving import describe_ms  # noqa: E402
from benchmarks.serving_load import Payload, run_load_processes, token_itl  # noqa: E402
from tokenizer_proc.frontend import Frontend  # noqa: E402
from tokenizer_proc.http_api import create_app  # noqa: E402
from tokenizer_proc.http_guard import edge_protocol  # noqa: E402
from tokenizer_proc.process import _Server  # noqa: E402
from tokenizer_proc.tokenizer import Tokenizer  # noqa: E402
from tokenizer_proc.validation import Limits  # noqa: E402

PIECES = (
    " the",
    " of",
    " and",
    ",",
    " a",
    " to",
    " in",
    ".",
    " is",
    " that",
    "\n",
    " model",
    ' "quoted"',
    " café",
    " 世界",
    " 🙂",
    " back\\slash",
    "\t",
    " tokens",
    " step",
    " serving",
    " for",
    " with",
    ":",
    " it",
)
TEXT = "".join(PIECES)  # what the streams' ids decode to, over and over
VOCAB_SIZE = 300  # of the trained BPE: 256 bytes, a special token, merges of common pieces
PROMPT_IDS = [11, 12, 13, 14]
LOGPROB = -0.25


# ----------------------------------------------------------------------------------------------
# The served tokenizer, and the ids the streams decode


def make_bench_tokenizer(directory: str) -> str:
    """A byte-level BPE (the scheme of Llama-3, Qwen and SmolLM2) trained on TEXT in a few
    milliseconds, saved as a Hugging Face tokenizer directory; its path. Its vocabulary is
    small, so that some characters of TEXT stay split across several tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([TEXT] * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    wrapped.save_pretrained(directory)
    return directory


def text_ids(tokenizer_path: str) -> tuple[list[int], list[int]]:
    """(TEXT's ids, where each piece's ids start): PIECES encoded one by one, without special
    tokens, so that a stream may start at any piece and wrap around at the end."""
    tokenizer = load_hf_tokenizer(tokenizer_path)
    ids: list[int] = []
    starts: list[int] = []
    for piece in PIECES:
        starts.append(len(ids))
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids, starts


# ----------------------------------------------------------------------------------------------
# Feeder: scheduler stand-in (its own process)


class FedStream:
    """One request the feeder is decoding: a token per step until max_new_tokens, TEXT's ids
    from a piece picked by its rid on."""

    def __init__(self, request: TokenizedRequest, ids: list[int], starts: list[int]) -> None:
        self.rid = request.rid
        self.frontend = request.frontend
        self.max_new_tokens = request.sampling.max_new_tokens
        self.logprobs = pack_floats([LOGPROB]) if request.return_logprob else None
        offset = int(request.rid[:6], 16) if request.rid[:6].isalnum() else 0
        self.ids = ids
        self.next = starts[offset % len(starts)]
        self.num_done = 0

    def add_step(self, writer: OutputsWriter) -> bool:
        """This step's token into writer; True when it ends the stream."""
        token_id = self.ids[self.next]
        self.next = (self.next + 1) % len(self.ids)
        self.num_done += 1
        done = self.num_done >= self.max_new_tokens
        finish = FinishReason("length") if done else None
        writer.add(self.frontend, self.rid, pack_ids([token_id]), 0, 0, self.logprobs, finish)
        return done


def run_feeder(
    inbox: str,
    server_inbox: str,
    step_s: float,
    stats: mp.Queue,
    ids: list[int],
    starts: list[int],
) -> None:
    """Until Shutdown: every step_s while streams run, one StepOutputs (a token per stream);
    ids, starts: `text_ids`."""
    receiver, sender = Receiver(inbox), Sender(server_inbox)
    streams: dict[str, FedStream] = {}
    writer = OutputsWriter()
    sent_at: list[float] = []
    next_at = 0.0
    while True:
        for message in receiver.drain() if streams else [receiver.recv()]:
            if isinstance(message, TokenizedRequest):
                streams[message.rid] = FedStream(message, ids, starts)
            elif isinstance(message, AbortRequest):
                streams.pop(message.rid, None)
            elif isinstance(message, Shutdown):
                stats.put(sent_at)
                return
        if not streams:
            continue
        wait = next_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        done = [rid for rid, stream in streams.items() if stream.add_step(writer)]
        for message in writer.take():  # one: every stream is frontend 0's
            sender.send(message)
        now = time.perf_counter()
        sent_at.append(now)
        next_at = max(next_at, now - step_s) + step_s  # late: the next step starts at once
        for rid in done:
            del streams[rid]


# ----------------------------------------------------------------------------------------------
# Server: the tokenizer process's app, its scheduler side replaced by the feeder


class FeederBackend:
    """The Frontend's backend: requests and aborts go to the feeder's inbox."""

    def __init__(self, address: str) -> None:
        self.sender = AsyncSender(address)

    async def submit(self, request: TokenizedRequest) -> None:
        await self.sender.send(request)

    def abort(self, rid: str):
        return self.sender.send(AbortRequest(rid))

    def finished(self, rid: str) -> None:
        pass


def payloads(args: argparse.Namespace) -> list[Payload]:
    sampling = {"max_new_tokens": args.output_len, "ignore_eos": True}
    if args.backend == "native":
        body = {
            "input_ids": PROMPT_IDS,
            "sampling_params": sampling,
            "stream": True,
            "return_logprob": args.return_logprob,
        }
        return [Payload("/generate", body, len(PROMPT_IDS))] * (args.streams * args.rounds)
    body = {
        "model": "bench",
        "prompt": "Once upon a time",
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "logprobs": 1 if args.return_logprob else None,
    }
    return [Payload("/v1/completions", body, len(PROMPT_IDS))] * (args.streams * args.rounds)


async def serve_and_load(
    args: argparse.Namespace, tokenizer: Tokenizer, feeder_inbox: str, server_inbox: str
) -> dict:
    """Run the server in this loop and the clients in their processes; the figures."""
    frontend = Frontend(
        tokenizer,
        Limits(vocab_size=tokenizer.vocab_size, context_length=args.output_len + 64),
        FeederBackend(feeder_inbox),  # type: ignore[arg-type]
        "bench",
    )
    frontend.mark_ready({"page_size": 1, "max_total_tokens": 1 << 20})
    inbox = AsyncReceiver(server_inbox)
    sock = http_socket("127.0.0.1", 0, shared=False, backlog=2048)
    config = uvicorn.Config(
        create_app(frontend),
        log_config=None,
        access_log=False,
        lifespan="off",
        http=edge_protocol(10.0),
        timeout_graceful_shutdown=1,
    )
    server = _Server(config)
    http = asyncio.create_task(server.serve(sockets=[sock]))

    async def read_inbox() -> None:
        while True:
            frontend.tracker.feed(await inbox.recv())

    reader = asyncio.create_task(read_inbox())
    while not server.started:
        await asyncio.sleep(0.01)
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    before = os.times()
    results, duration, client_cpu = await asyncio.get_running_loop().run_in_executor(
        None,
        run_load_processes,
        base_url,
        payloads(args),
        math.inf,
        args.streams,
        0,
        args.client_processes,
    )
    after = os.times()
    server.should_exit = True
    await http
    reader.cancel()
    inbox.close()
    cpu = (after.user - before.user, after.system - before.system)
    return figures(args, results, duration, cpu, client_cpu)


# ----------------------------------------------------------------------------------------------
# Report


def figures(args, results, duration: float, server_cpu: tuple, client_cpu: float) -> dict:
    """The report; server_cpu: (user, system) seconds of this process during the load."""
    ok = [r for r in results if r.success]
    events = max(sum(len(r.itl) + 1 for r in ok), 1)
    tokens = sum(r.output_len for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "offered_events_per_s": args.streams / (args.step_ms / 1000),
        "events_per_s": events / duration,
        "tokens_per_s": tokens / duration,
        "tokens_per_event": tokens / events,
        "itl_ms": describe_ms([gap for r in ok for gap in r.itl]),
        "token_itl_ms": describe_ms([g for r in ok for g in token_itl(r.itl, r.itl_tokens)]),
        "server_cpu_us_per_event": sum(server_cpu) / events * 1e6,
        "server_sys_us_per_event": server_cpu[1] / events * 1e6,
        "server_cpu_share": sum(server_cpu) / duration,
        "client_cpu_us_per_event": client_cpu / events * 1e6,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def print_figures(out: dict) -> None:
    print(f"{'completed / failed':<30}{out['completed']} / {out['failed']}")
    print(
        f"{'events/s (offered)':<30}{out['events_per_s']:,.0f} ({out['offered_events_per_s']:,.0f})"
    )
    print(f"{'tokens/s':<30}{out['tokens_per_s']:,.0f}")
    print(f"{'tokens per event':<30}{out['tokens_per_event']:.2f}")
    print(
        f"{'ITL per chunk median / p99':<30}{out['itl_ms']['median']:.2f} / "
        f"{out['itl_ms']['p99']:.2f} ms"
    )
    print(f"{'ITL per token median':<30}{out['token_itl_ms']['median']:.2f} ms")
    print(
        f"{'server CPU per event':<30}{out['server_cpu_us_per_event']:.1f} us, "
        f"{out['server_sys_us_per_event']:.1f} in the kernel "
        f"({out['server_cpu_share']:.0%} of a core)"
    )
    print(f"{'client CPU per event':<30}{out['client_cpu_us_per_event']:.1f} us")
    print(
        f"{'feeder step median / p99':<30}{out['step_ms']['median']:.2f} / "
        f"{out['step_ms']['p99']:.2f} ms"
    )
    for error in out["errors"]:
        print(f"error: {error}", file=sys.stderr)


def step_periods(sent_at: list[float]) -> dict[str, float]:
    """The feeder's step period (ms), median and p99, leaving out idle gaps."""
    periods = [(b - a) * 1e3 for a, b in zip(sent_at, sent_at[1:], strict=False) if b - a < 0.1]
    if len(periods) < 2:
        return {"median": 0.0, "p99": 0.0}
    return {"median": statistics.median(periods), "p99": statistics.quantiles(periods, n=100)[98]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming requests")
    p.add_argument("--step-ms", type=float, default=1.35, help="one token per stream this often")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request")
    p.add_argument("--rounds", type=int, default=4, help="requests: rounds x streams")
    p.add_argument("--backend", choices=("native", "openai"), default="native")
    p.add_argument("--return-logprob", action="store_true")
    p.add_argument("--client-processes", type=int, default=1)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a model directory whose tokenizer serves (default: a small BPE trained at start)",
    )
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runtime_dir = tempfile.mkdtemp(prefix="aerie-delivery-")
    feeder_inbox, server_inbox = f"ipc://{runtime_dir}/feeder", f"ipc://{runtime_dir}/tokenizer"
    ctx = mp.get_context("spawn")
    stats = ctx.Queue()
    feeder = None
    try:
        tokenizer_path = args.tokenizer or make_bench_tokenizer(f"{runtime_dir}/bpe")
        tokenizer = Tokenizer(tokenizer_path)
        ids, starts = text_ids(tokenizer_path)
        feeder = ctx.Process(
            target=run_feeder,
            daemon=True,
            args=(feeder_inbox, server_inbox, args.step_ms / 1000, stats, ids, starts),
        )
        feeder.start()
        out = uvloop.run(serve_and_load(args, tokenizer, feeder_inbox, server_inbox))
        stop = Sender(feeder_inbox)
        stop.send(Shutdown())
        sent_at = stats.get(timeout=10)
        stop.close()
        feeder.join(10)
    finally:
        if feeder is not None and feeder.is_alive():
            feeder.kill()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    out["step_ms"] = step_periods(sent_at)
    out["args"] = vars(args)
    print_figures(out)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
