"""Soak a launched Aerie server with a random mix of clients, then check that nothing leaked.

    python tools/soak.py --requests 10000 --output soak.json
    python tools/soak.py --requests 2000 --speculative EAGLE          # with a tiny EAGLE draft
    python tools/soak.py --requests 2000 --disable-overlap-schedule   # one plan in flight

launches `launch.py --device cpu` on a tiny random checkpoint (built in a temporary directory;
`--model-path` picks another) with a KV cache too small for every request at once and
`--schedule-conservativeness 0`, so that requests are retracted and recomputed. The requests
come from a pool of prompts whose single-request greedy outputs are taken first, one at a time,
and are a seeded random mix (`KIND_WEIGHTS`) of: HTTP /generate streaming and not, the OpenAI
/v1/completions endpoint, the ZMQ client streaming and not, stop strings, sampled requests,
HTTP clients that disconnect mid-stream or time out, ZMQ streams closed early (an abort) and
ZMQ generates that time out (an abort). At most `--concurrency` are in flight.

The prefix cache is on (the default); the references are taken with it flushed, and most
prompts share a stem with others. At the end every completed greedy request must equal its
prompt's single-request output (a prefix of it, cut where a stop string completes), the engine
must be idle with no KV in use and, after `/flush_cache`, every page free exactly once, and no
process may have grown its resident memory by more than `--max-rss-growth` since
warm-up (the first `--warmup-fraction` of the requests). Exit status 1 and a list of problems
otherwise. tests/e2e/test_soak.py runs a reduced size in CI.

A stuck request (no reply while many others finish), or a soak past `--time-limit-s`, stops the
soak with a report of what the client saw and where the server holds it (`tools/soak_watch`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.client import AerieClientError, AerieTimeoutError, AsyncClient  # noqa: E402
from tools import soak_watch  # noqa: E402
from tools.soak_plan import (  # noqa: E402
    GREEDY_KINDS,
    MAX_NEW,
    NUM_PROMPTS,
    Planned,
    expected_stop,
    plan_requests,
    random_prompts,
)
from tools.soak_server import rss_mib, server_pids, soak_server_args  # noqa: E402
from tools.soak_watch import StuckWatch, client_rid, describe_stuck, stuck_problems  # noqa: E402


@dataclass
class Outcome:
    index: int
    kind: str
    status: str  # "ok" | "aborted" | "failed"
    detail: str = ""


@dataclass
class Report:
    requests: int
    concurrency: int
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    greedy_checked: int = 0
    stopped_by_string: int = 0
    num_retractions: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served
    idle: dict = field(default_factory=dict)
    rss_warm_mib: dict[str, float] = field(default_factory=dict)
    rss_end_mib: dict[str, float] = field(default_factory=dict)
    rss_growth: dict[str, float] = field(default_factory=dict)
    max_overtaken: int = 0  # the most requests that finished while one waited for a reply
    stuck: dict = field(default_factory=dict)  # `describe_stuck`, when the soak stopped
    problems: list[str] = field(default_factory=list)


class Soak:
    def __init__(
        self,
        url: str,
        zmq_address: str,
        prompts: list[list[int]],
        decode_raw,
        concurrency: int,
        deadline: float | None = None,
    ) -> None:
        """deadline: time.monotonic() past which `run` stops and reports what is in flight."""
        self.url, self.zmq_address = url, zmq_address
        self.prompts = prompts
        self.decode_raw = decode_raw  # skip_special_tokens=False, as the stop-string check
        self.concurrency = concurrency
        self.deadline = deadline
        self.references: list[list[int]] = []
        self.reference_texts: list[str] = []
        self.watch = StuckWatch(concurrency)
        self.stuck: dict = {}  # `describe_stuck`, once run stopped on a stuck request

    async def take_references(self, http: httpx.AsyncClient) -> None:
        """Each prompt's greedy output, one request at a time (the single-request output),
        computed from nothing cached: every later output is checked against a full prefill."""
        for ids in self.prompts:
            body = {"input_ids": ids, "sampling_params": greedy(MAX_NEW)}
            for _ in range(20):  # the last reference's KV may reach the cache after the flush
                (await http.post(self.url + "/flush_cache", json={})).raise_for_status()
                response = await http.post(self.url + "/generate", json=body)
                response.raise_for_status()
                if response.json()["meta_info"]["cached_tokens"] == 0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("every reference reused a cached prefix despite a flush")
            self.references.append(response.json()["output_ids"])
            self.reference_texts.append(response.json()["text"])

    def check_greedy(self, req: Planned, output_ids: list[int], finish: dict) -> str:
        """'' when output_ids is what the single-request output says; else what differs."""
        reference = self.references[req.prompt]
        n = req.max_new
        if req.stop is not None:
            n = expected_stop(reference[: req.max_new], req.stop, self.decode_raw)
        want_finish = ("stop", req.stop) if req.stop is not None else ("length", None)
        if output_ids != reference[:n]:
            return f"output {output_ids} != single-request {reference[:n]}"
        if (finish["type"], finish.get("matched")) != want_finish:
            return f"finish {finish} != {want_finish}"
        return ""

    async def run_one(self, req: Planned, http: httpx.AsyncClient, zmq: AsyncClient) -> Outcome:
        ids = self.prompts[req.prompt]
        params = greedy(req.max_new)
        if req.stop is not None:
            params["stop"] = [req.stop]
        try:
            detail = await getattr(self, "_" + req.kind)(req, ids, params, http, zmq)
        except (httpx.HTTPError, AerieClientError, AssertionError, KeyError) as exc:
            return Outcome(req.index, req.kind, "failed", f"{type(exc).__name__}: {exc}")
        if detail is None:
            return Outcome(req.index, req.kind, "aborted")
        return Outcome(req.index, req.kind, "failed" if detail else "ok", detail)

    # Each kind returns '' (checked, equal), a difference, or None (aborted on purpose), and
    # tells `watch` what it receives before the end.

    def body(self, req: Planned, ids: list[int], params: dict, stream: bool = False) -> dict:
        """A /generate body (with the request's client rid)."""
        rid = client_rid(req)
        return {"input_ids": ids, "sampling_params": params, "rid": rid, "stream": stream}

    async def _http(self, req, ids, params, http, zmq):
        response = await http.post(self.url + "/generate", json=self.body(req, ids, params))
        assert response.status_code == 200, response.text
        out = response.json()
        return self.check_greedy(req, out["output_ids"], out["meta_info"]["finish_reason"])

    _stop = _http

    async def _http_stream(self, req, ids, params, http, zmq):
        body = self.body(req, ids, params, stream=True)
        output_ids, finish = [], None  # each event carries the output so far
        async with http.stream("POST", self.url + "/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for event in sse_events(response):
                if event["output_ids"][: len(output_ids)] != output_ids:
                    return f"event {event['output_ids']} does not extend {output_ids}"
                output_ids = event["output_ids"]
                finish = event["meta_info"]["finish_reason"] or finish
                self.watch.reply(req.index, output_ids)
        return self.check_greedy(req, output_ids, finish)

    async def _openai(self, req, ids, params, http, zmq):
        """The full length, so that the text compares with the single-request text."""
        body = {"prompt": ids, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        response = await http.post(self.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        if out["usage"]["completion_tokens"] != MAX_NEW:
            return f"completion_tokens {out['usage']['completion_tokens']} != {MAX_NEW}"
        got, want = out["choices"][0]["text"], self.reference_texts[req.prompt]
        return "" if got == want else f"text {got!r} != single-request {want!r}"

    async def _zmq(self, req, ids, params, http, zmq):
        rid = client_rid(req)
        out = await zmq.generate(input_ids=ids, sampling_params=params, rid=rid, timeout=300)
        return self.check_greedy(req, out["output_ids"], out["meta_info"]["finish_reason"])

    async def _zmq_stream(self, req, ids, params, http, zmq):
        output_ids, finish = [], None
        rid = client_rid(req)
        async for delta in zmq.stream(input_ids=ids, sampling_params=params, rid=rid, timeout=300):
            output_ids += delta["output_ids"]
            finish = delta["meta_info"]["finish_reason"] or finish
            self.watch.reply(req.index, output_ids)
        return self.check_greedy(req, output_ids, finish)

    async def _sampled(self, req, ids, params, http, zmq):
        params = {
            "max_new_tokens": req.max_new,
            "temperature": 0.8,
            "top_p": 0.9,
            "ignore_eos": True,
        }
        response = await http.post(self.url + "/generate", json=self.body(req, ids, params))
        assert response.status_code == 200, response.text
        got = len(response.json()["output_ids"])
        return "" if got == req.max_new else f"{got} tokens != {req.max_new}"

    async def _http_disconnect(self, req, ids, params, http, zmq):
        """Read the first event of a stream, then hang up."""
        params["max_new_tokens"] = MAX_NEW
        body = self.body(req, ids, params, stream=True)
        async with http.stream("POST", self.url + "/generate", json=body) as response:
            async for _ in sse_events(response):
                self.watch.reply(req.index)
                break
        return None

    async def _http_timeout(self, req, ids, params, http, zmq):
        """A non-streaming request whose client gives up before the answer."""
        params["max_new_tokens"] = MAX_NEW
        try:
            await http.post(self.url + "/generate", json=self.body(req, ids, params), timeout=0.02)
        except httpx.TimeoutException:
            pass
        return None

    async def _zmq_abort(self, req, ids, params, http, zmq):
        """Leave a stream after its first delta: the client sends an abort."""
        params["max_new_tokens"] = MAX_NEW
        rid = client_rid(req)
        stream = zmq.stream(input_ids=ids, sampling_params=params, rid=rid, timeout=300)
        async for _ in stream:
            self.watch.reply(req.index)
            break
        await stream.aclose()
        return None

    async def _zmq_timeout(self, req, ids, params, http, zmq):
        params["max_new_tokens"] = MAX_NEW
        try:
            rid = client_rid(req)
            await zmq.generate(input_ids=ids, sampling_params=params, rid=rid, timeout=0.02)
        except AerieTimeoutError:
            pass
        return None

    async def run(self, planned: list[Planned], on_progress) -> list[Outcome]:
        """Every planned request, at most `concurrency` at a time; on_progress(done) after each.
        Stops at the first stuck request, or at the deadline, with `stuck` set (the requests
        still in flight then have no outcome)."""
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        outcomes: list[Outcome] = []
        queue = iter(planned)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            zmq = AsyncClient(self.zmq_address)

            async def worker() -> None:
                for req in queue:
                    self.watch.start(req, client_rid(req))
                    outcomes.append(await self.run_one(req, http, zmq))
                    self.watch.finish(req.index)
                    on_progress(len(outcomes))

            workers = [asyncio.ensure_future(worker()) for _ in range(self.concurrency)]
            try:
                await self.watch_workers(workers, http)
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                zmq.close()
        return sorted(outcomes, key=lambda o: o.index)

    async def watch_workers(self, workers: list[asyncio.Future], http: httpx.AsyncClient) -> None:
        """Wait for the workers (raising any one's error), checking every WATCH_INTERVAL_S for
        a stuck request and the deadline; sets `stuck` when either stops the soak."""
        pending = set(workers)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=soak_watch.WATCH_INTERVAL_S)
            for task in done:
                task.result()
            why, stuck = self.watch.stuck()
            if not why and self.deadline is not None and time.monotonic() > self.deadline:
                why = "the soak ran past its time limit"
                stuck = sorted(self.watch.flights.values(), key=lambda f: f.last_reply)
            if why:
                watch, prompts = self.watch, self.prompts
                self.stuck = await describe_stuck(why, stuck, watch, prompts, self.url, http)
                return


def greedy(max_new: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


async def sse_events(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


async def wait_idle(url: str, timeout_s: float) -> dict:
    """/server_info once nothing runs or waits and no KV is in use (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            info = (await http.get(url + "/server_info")).json()
            busy = info["num_running"], info["num_waiting"], info["kv_used_tokens"]
            if busy == (0, 0, 0) or time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.1)


def flush_problems(response: httpx.Response) -> list[str]:
    """What is wrong with /flush_cache's answer on an idle server: each scheduler must hold no
    cached KV after it, and every page must be free exactly once (`kv_whole`)."""
    if response.status_code != 200:
        return [f"/flush_cache answered {response.status_code}: {response.text[:300]}"]
    bad = [
        r
        for r in response.json()["replicas"]
        if r.get("prefix_cache_tokens") != 0 or r.get("kv_whole") is not True
    ]
    return [f"KV not whole after /flush_cache: {r}" for r in bad]


def soak(
    url: str,
    zmq_address: str,
    pids: dict[str, int],
    tokenizer_dir: str,
    vocab: int,
    requests: int,
    concurrency: int,
    seed: int,
    warmup_fraction: float,
    max_rss_growth: float,
    log=print,
    time_limit_s: float | None = None,
) -> Report:
    """Run the soak against a live server and return the report (problems listed in it).
    time_limit_s: from now; past it the soak stops and reports the requests in flight."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    rng = random.Random(seed)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    runner = Soak(
        url,
        zmq_address,
        random_prompts(rng, vocab, NUM_PROMPTS),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        concurrency,
        deadline,
    )
    report = Report(requests, concurrency)

    async def main() -> list[Outcome]:
        async with httpx.AsyncClient(timeout=300) as http:
            await runner.take_references(http)
        planned = plan_requests(rng, requests, runner.references, runner.decode_raw)
        report.kinds = dict(Counter(p.kind for p in planned))
        warm_at = max(1, int(requests * warmup_fraction))
        step = max(1, requests // 20)

        def on_progress(done: int) -> None:
            if done == warm_at:
                report.rss_warm_mib = rss_mib(pids)
            if done % step == 0 or done == requests:
                log(f"soak: {done}/{requests} requests, {time.monotonic() - start:.0f} s")

        start = time.monotonic()
        outcomes = await runner.run(planned, on_progress)
        report.seconds = round(time.monotonic() - start, 1)
        report.idle = await wait_idle(url, timeout_s=5 if runner.stuck else 60)
        report.cached_prompt_tokens = report.idle.get("cached_prefill_tokens", 0)
        if not runner.stuck:
            async with httpx.AsyncClient(timeout=60) as http:
                report.problems += flush_problems(await http.post(url + "/flush_cache", json={}))
        return outcomes

    outcomes = asyncio.run(main())
    report.rss_end_mib = rss_mib(pids)
    report.statuses = dict(Counter(o.status for o in outcomes))
    report.greedy_checked = sum(o.kind in GREEDY_KINDS and o.status == "ok" for o in outcomes)
    report.stopped_by_string = sum(o.kind == "stop" and o.status == "ok" for o in outcomes)
    report.num_retractions = report.idle.get("num_retractions", 0)
    report.max_overtaken = runner.watch.max_overtaken
    report.stuck = runner.stuck
    report.problems += stuck_problems(runner.stuck)
    report.problems += [
        f"request {o.index} ({o.kind}): {o.detail}" for o in outcomes if o.status == "failed"
    ][:20]
    busy = {k: report.idle.get(k) for k in ("num_running", "num_waiting", "kv_used_tokens")}
    if any(busy.values()):
        report.problems.append(f"not idle at the end: {busy}")
    for name, warm in report.rss_warm_mib.items():
        growth = report.rss_end_mib[name] / warm - 1
        report.rss_growth[name] = round(growth, 4)
        if growth > max_rss_growth:
            report.problems.append(
                f"{name} grew from {warm:.0f} to {report.rss_end_mib[name]:.0f} MiB after warm-up"
                f" ({growth:.1%} > {max_rss_growth:.0%})"
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--model-path", help="default: a tiny random Llama built for the run")
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="serve with a tiny random EAGLE draft of the tiny model",
    )
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--time-limit-s", type=float, help="stop and report what is in flight")
    parser.add_argument("--output", help="write the report here as JSON")
    args = parser.parse_args(argv)

    from tests.e2e.server import Server
    from tests.gpu_worker.checkpoints import make_tiny_checkpoint
    from tests.tokenizer_fixture import make_tiny_tokenizer

    with tempfile.TemporaryDirectory(prefix="aerie-soak-") as tmp:
        model_path, draft_path = args.model_path, None
        if model_path is None:
            model_path = os.path.join(tmp, "target")
            make_tiny_checkpoint(model_path, "llama", vocab_size=384, max_position_embeddings=512)
            make_tiny_tokenizer(model_path)
        if args.speculative:
            if args.model_path is not None:
                parser.error("--speculative builds a draft for the tiny model only")
            from tests.gpu_worker.draft_checkpoints import make_tiny_eagle_draft

            draft_path = make_tiny_eagle_draft(os.path.join(tmp, "draft"), model_path)
        server_args = soak_server_args(
            model_path, args.concurrency, draft_path, overlap=not args.disable_overlap_schedule
        )
        with Server(*server_args) as server:
            print(f"soak: server at {server.url}, log {server.log.name}", flush=True)
            report = soak(
                server.url,
                server.zmq_address,
                server_pids(server),
                model_path,
                vocab=320,
                requests=args.requests,
                concurrency=args.concurrency,
                seed=args.seed,
                warmup_fraction=args.warmup_fraction,
                max_rss_growth=args.max_rss_growth,
                time_limit_s=args.time_limit_s,
            )
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
