"""The soak client's watch for stuck requests, and its report of them (`tools/soak.py`).

`StuckWatch` keeps the requests in flight as the client sees them: when each was sent, when it
last received anything, what it received, and how many other requests finished meanwhile. A
request is stuck when the engine moves and it does not (see STUCK_OVERTAKEN), which does not
depend on how fast the machine is. `describe_stuck` then asks the server where it holds them
(`/server_info`, and `/debug/requests` of a server started with --enable-debug-info) and
`stuck_problems` turns that into the soak report's problem lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from tools.soak_plan import Planned

# Stuck: no reply for STUCK_MIN_S while STUCK_OVERTAKEN x concurrency other requests finished
# (the engine moves and the request does not: on a slow or loaded machine fewer others finish
# in the same time, so this does not fire there), or no request at all finished for
# ENGINE_STALL_S (the engine does not move).
STUCK_OVERTAKEN = 8
STUCK_MIN_S = 30.0
ENGINE_STALL_S = 180.0
WATCH_INTERVAL_S = 1.0
MAX_STUCK_REPORTED = 4


@dataclass
class Flight:
    """A request in flight, as the client sees it."""

    req: Planned
    rid: str | None  # the client rid it was sent with (None: its kind sends none)
    started: float
    last_reply: float  # when it last received anything (when it was sent, until then)
    finished_then: int  # requests finished at last_reply
    output_ids: list[int] = field(default_factory=list)  # received so far
    num_replies: int = 0


class StuckWatch:
    """The requests in flight and which of them are stuck (see STUCK_OVERTAKEN); `clock`
    is time.monotonic but for tests."""

    def __init__(self, concurrency: int, clock=time.monotonic) -> None:
        self.overtaken = STUCK_OVERTAKEN * concurrency
        self.clock = clock
        self.flights: dict[int, Flight] = {}
        self.num_finished = 0
        self.last_finish = clock()
        self.max_overtaken = 0

    def start(self, req: Planned, rid: str | None) -> None:
        now = self.clock()
        self.flights[req.index] = Flight(req, rid, now, now, self.num_finished)

    def reply(self, index: int, output_ids: list[int] | None = None) -> None:
        """Request `index` received something; output_ids: all its outputs so far."""
        flight = self.flights[index]
        self._count_overtaken(flight)
        flight.last_reply, flight.finished_then = self.clock(), self.num_finished
        flight.num_replies += 1
        if output_ids is not None:
            flight.output_ids = list(output_ids)

    def finish(self, index: int) -> None:
        self._count_overtaken(self.flights.pop(index))
        self.num_finished += 1
        self.last_finish = self.clock()

    def _count_overtaken(self, flight: Flight) -> None:
        self.max_overtaken = max(self.max_overtaken, self.num_finished - flight.finished_then)

    def stuck(self) -> tuple[str, list[Flight]]:
        """(why, the stuck requests, longest without a reply first), or ("", [])."""
        now = self.clock()
        waiting = sorted(self.flights.values(), key=lambda f: f.last_reply)
        if waiting and now - self.last_finish >= ENGINE_STALL_S:
            return f"no request finished for {now - self.last_finish:.0f} s", waiting
        overtaken = [f for f in waiting if self.num_finished - f.finished_then >= self.overtaken]
        stuck = [f for f in overtaken if now - f.last_reply >= STUCK_MIN_S]
        if not stuck:
            return "", []
        return f"no reply while {self.overtaken} or more others finished", stuck


def client_rid(req: Planned) -> str | None:
    """The rid a request is sent with, to find it on the server (the OpenAI API has none)."""
    return None if req.kind == "openai" else f"soak-{req.index}"


async def describe_stuck(
    why: str,
    flights: list[Flight],
    watch: StuckWatch,
    prompts: list[list[int]],
    url: str,
    http: httpx.AsyncClient,
) -> dict:
    """What the client saw of `flights` (the first MAX_STUCK_REPORTED, found stuck by `watch`
    for `why`; prompts: the soak's prompt pool) and where the server at url holds them."""
    info = await get_json(http, url + "/server_info")
    debug = await get_json(http, url + "/debug/requests")
    keys = ("num_running", "num_waiting", "kv_used_tokens", "num_in_flight", "error")
    schedulers = [
        {key: value for key, value in scheduler.items() if key != "requests"}
        for scheduler in debug.get("schedulers", [])
    ]
    now = time.monotonic()
    requests = []
    for flight in flights[:MAX_STUCK_REPORTED]:
        req = flight.req
        requests.append(
            {
                "index": req.index,
                "kind": req.kind,
                "rid": flight.rid,
                "prompt_ids": prompts[req.prompt],
                "max_new_tokens": req.max_new,
                "stop": req.stop,
                "seconds_in_flight": round(now - flight.started, 1),
                "seconds_without_reply": round(now - flight.last_reply, 1),
                "finished_meanwhile": watch.num_finished - flight.finished_then,
                "replies": flight.num_replies,
                "output_ids": flight.output_ids,
                "server": locate(flight.rid, debug),
            }
        )
    return {
        "why": why,
        "in_flight": len(watch.flights),
        "server": {key: info[key] for key in keys if key in info},
        "schedulers": schedulers,
        "requests": requests,
        "debug": debug,
    }


async def get_json(http: httpx.AsyncClient, url: str) -> dict:
    """The JSON at url, or {"error": why not} (a debug view must not fail the report)."""
    try:
        response = await http.get(url, timeout=10)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if response.status_code != 200:
        return {"error": f"{response.status_code}: {response.text[:200]}"}
    return response.json()


def locate(rid: str | None, debug: dict) -> str:
    """Where the server holds the request sent with client rid `rid`, in words, from its
    /debug/requests view `debug`."""
    if "tokenizer" not in debug:
        return f"unknown: no /debug/requests ({debug.get('error')})"
    if rid is None:
        return "unknown: sent without a client rid"
    entry = next((e for e in debug["tokenizer"] if e["id"] == rid), None)
    if entry is None:
        return "not in flight in the tokenizer: it finished there, or never got there"
    pending = ", output its consumer has not taken" if entry["chunk_pending"] else ""
    where = [f"tokenizer: in flight {entry['age_s']} s, {entry['output_tokens']} tokens{pending}"]
    for scheduler in debug["schedulers"]:
        name = f"scheduler {scheduler['replica']}"
        if not scheduler["answered"]:
            where.append(f"{name}: did not answer")
        for held in scheduler.get("requests", []):
            if held["rid"] == entry["rid"]:
                where.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in held.items()))
    if len(where) == 1:
        where.append("no scheduler holds it: it never reached one, or its finish was lost")
    return "; ".join(where)


def stuck_problems(stuck: dict) -> list[str]:
    """The report's problem lines for a soak stopped by `Soak.describe_stuck`."""
    if not stuck:
        return []
    server, schedulers = stuck["server"], stuck["schedulers"]
    lines = [
        f"stopped: {stuck['why']}, with {stuck['in_flight']} requests in flight; "
        f"server {server}, schedulers {schedulers}"
    ]
    for r in stuck["requests"]:
        lines.append(
            f"stuck: request {r['index']} ({r['kind']}, rid {r['rid']}), "
            f"{r['seconds_without_reply']} s without a reply while {r['finished_meanwhile']} "
            f"others finished ({r['seconds_in_flight']} s in flight); prompt {r['prompt_ids']}, "
            f"max_new_tokens {r['max_new_tokens']}, stop {r['stop']!r}; received "
            f"{r['replies']} replies, output {r['output_ids']}; where: {r['server']}"
        )
    return lines
