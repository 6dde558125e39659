"""Where a served step's time goes, from the host timestamps `AERIE_STEP_TRACE` writes
(`aerie/step_trace.py`): the chain from one step's result to the launch of the step planned
after it, link by link, and how long the device waited for that launch.

    python3 tools/step_trace_summary.py DIR [--mode decode] [--batch-size 48-64] [--json OUT]

For each traced step N whose result was applied, with M the next plan the scheduler sent after
applying it (N+2 with the overlap schedule, N+1 without; see `with_previous` for when it is N+1
with the overlap schedule too):
    pack        ready(N) -> result_out(N)       the worker waits for and packs the result
    to_sched    result_out(N) -> result_in(N)   encode, socket hop, decode
    apply       result_in(N) -> applied(N)      outputs, finishes, KV
    plan        applied(N) -> plan_out(M)       choosing and building the next plan
    to_worker   plan_out(M) -> plan_in(M)       encode, socket hop, decode
    launch      plan_in(M) -> launched(M)       parse, upload, replay; split, when traced, into
      parse       plan_in -> parsed               the plan's arrays, new rows started
      slots       parsed -> slots_written         the KV slots' flat indices and the variant
      step        slots_written -> stepped        one copy of rows and slots, the replay
      results     stepped -> launched             the copy of the results started
    chain       ready(N) -> launched(M)         all of the above
    wait        launched(M) - ready(M-1), if positive: the device had finished everything
                queued before M and waited for the host (to within one worker poll)
    period      ready(M-1) -> ready(M)          one step of the served loop
The idle estimate is sum(wait) / sum(period) over the steps with every event; it reads low
when the worker is busy launching as a step ends (it sees `ready` late). On CUDA the worker
also times each step with CUDA events (gpu_gap_us, gpu_span_us): the device's own idle time
between steps, printed as "device idle between steps".
Also printed: `busy`, result_in(N) -> done(N), all the scheduler does for a step (the chain's
part plus sending the deltas and stats): the served loop cannot step faster than that.

Each row also has plan_id (N), next_plan_id (M), batch_size (M's rows) and, when N-1 was traced,
with_previous: whether N's result came in before the scheduler's loop had ended the pass that
applied N-1's (result_in(N) < done(N-1)), so that one pass applied both: the scheduler had
fallen a step behind the worker. With two plans in flight the loop tries to plan N+1 as soon
as N is the only plan in flight: right after sending N if nothing else was in flight, else
after the pass that applies N-1's result. So M is N+1 instead of N+2 exactly when that pass
applied N's result too (with_previous), or when N+1 could not be planned then (a decode step
waiting for KV that the plans in flight hold; or, with M not a decode step, no work or nobody
left to decode). The pass after a with_previous pair sends two plans, so with_previous never
holds for two consecutive steps.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

LINKS = [
    ("pack", "ready", "result_out"),
    ("to_sched", "result_out", "result_in"),
    ("apply", "result_in", "applied"),
]
NEXT_LINKS = [("to_worker", "plan_out", "plan_in"), ("launch", "plan_in", "launched")]
LAUNCH_PARTS = [
    ("parse", "plan_in", "parsed"),
    ("slots", "parsed", "slots_written"),
    ("step", "slots_written", "stepped"),
    ("results", "stepped", "launched"),
]
COLUMNS = [
    "pack",
    "to_sched",
    "apply",
    "plan",
    "to_worker",
    "launch",
    "parse",
    "slots",
    "step",
    "results",
    "chain",
    "wait",
    "period",
    "busy",
]


def load(directory: str) -> tuple[dict[int, dict[str, int]], dict[int, tuple[str, int]]]:
    """Every trace file of DIR merged: plan id -> {event: ns}, and plan id -> (mode, batch)."""
    events: dict[int, dict[str, int]] = {}
    plans: dict[int, tuple[str, int]] = {}
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))
    if not paths:
        raise SystemExit(f"no trace files in {directory} (was AERIE_STEP_TRACE set?)")
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for event, plan_id, ns in data["events"]:
            events.setdefault(plan_id, {})[event] = ns
        plans.update({int(k): tuple(v) for k, v in data["plans"].items()})
    return events, plans


def step_chains(
    events: dict[int, dict[str, int]], plans: dict[int, tuple[str, int]], mode: str | None
) -> list[dict[str, float]]:
    """One row per step N with every link of its chain (microseconds; see the docstring).
    mode: keep only steps whose plan N, M-1 and M all have this mode (None: every step)."""
    sent = sorted((ev["plan_out"], plan_id) for plan_id, ev in events.items() if "plan_out" in ev)
    rows = []
    for plan_id, ev in sorted(events.items()):
        if "applied" not in ev:
            continue
        later = [m for t, m in sent if t >= ev["applied"] and m > plan_id]
        if not later:
            continue
        nxt = later[0]
        chain_plans = (plan_id, nxt - 1, nxt)
        if mode is not None and any(plans.get(p, ("",))[0] != mode for p in chain_plans):
            continue
        nev, prev = events.get(nxt, {}), events.get(nxt - 1, {})
        needed = [(ev, e) for _, a, b in LINKS for e in (a, b)]
        needed += [(nev, e) for _, a, b in NEXT_LINKS for e in (a, b)] + [(prev, "ready")]
        if any(e not in where for where, e in needed):
            continue
        row = {name: (ev[b] - ev[a]) / 1e3 for name, a, b in LINKS}
        row["plan"] = (nev["plan_out"] - ev["applied"]) / 1e3
        row.update({name: (nev[b] - nev[a]) / 1e3 for name, a, b in NEXT_LINKS})
        row.update(
            {name: (nev[b] - nev[a]) / 1e3 for name, a, b in LAUNCH_PARTS if a in nev and b in nev}
        )
        row["chain"] = (nev["launched"] - ev["ready"]) / 1e3
        row["wait"] = max(0.0, (nev["launched"] - prev["ready"]) / 1e3)
        if "ready" in nev:
            row["period"] = (nev["ready"] - prev["ready"]) / 1e3
        if "done" in ev:
            row["busy"] = (ev["done"] - ev["result_in"]) / 1e3
        before = events.get(plan_id - 1, {})
        if "done" in before:  # N-1's pass had not ended when N's result came in
            row["with_previous"] = before["done"] > ev["result_in"]
        row["plan_id"], row["next_plan_id"] = plan_id, nxt
        row["batch_size"] = plans.get(nxt, ("", 0))[1]
        rows.append(row)
    return rows


def device_idle(
    events: dict[int, dict[str, float]],
    plans: dict[int, tuple[str, int]],
    mode: str | None,
    batch: tuple[int, int],
) -> dict | None:
    """From the CUDA events around each launch (gpu_gap_us, gpu_span_us), over the steps of
    `mode` whose batch size is in [low, high]: the share of device time spent idle between
    steps, and the median span of a step. None without those values (not on CUDA)."""
    gaps, spans = [], []
    for plan_id, ev in events.items():
        kind, size = plans.get(plan_id, ("", 0))
        if "gpu_gap_us" not in ev or (mode is not None and kind != mode):
            continue
        if batch[0] <= size <= batch[1]:
            gaps.append(ev["gpu_gap_us"])
            spans.append(ev["gpu_span_us"])
    if not gaps:
        return None
    return {
        "steps": len(gaps),
        "idle_between_steps": sum(gaps) / (sum(gaps) + sum(spans)),
        "gap_median_us": statistics.median(gaps),
        "span_median_us": statistics.median(spans),
    }


def summarise(rows: list[dict[str, float]]) -> dict:
    """Median and mean of each link, and the idle estimate over rows with a period."""
    out: dict = {"steps": len(rows)}
    for name in COLUMNS:
        values = [r[name] for r in rows if name in r]
        if values:
            out[name] = {"median": statistics.median(values), "mean": statistics.fmean(values)}
    timed = [r for r in rows if "period" in r]
    total = sum(r["period"] for r in timed)
    out["idle_estimate"] = sum(r["wait"] for r in timed) / total if total > 0 else None
    if rows:
        out["batch_size_median"] = statistics.median(r["batch_size"] for r in rows)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument(
        "--mode",
        default="decode",
        help="'decode' (plain steps), 'speculate' (speculative iterations), 'extend' or 'all'",
    )
    parser.add_argument("--batch-size", default="1-100000", help="next plan's rows: N or LO-HI")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    events, plans = load(args.directory)
    low, _, high = args.batch_size.partition("-")
    batch, mode = (int(low), int(high or low)), None if args.mode == "all" else args.mode
    rows = [
        row for row in step_chains(events, plans, mode) if batch[0] <= row["batch_size"] <= batch[1]
    ]
    summary = summarise(rows)
    summary["device"] = device_idle(events, plans, mode, batch)
    print(
        f"{summary['steps']} {args.mode} steps, median batch "
        f"{summary.get('batch_size_median', 0):g}; microseconds:"
    )
    print(f"{'link':>10} {'median':>9} {'mean':>9}")
    for name in COLUMNS:
        if name in summary:
            print(f"{name:>10} {summary[name]['median']:>9.1f} {summary[name]['mean']:>9.1f}")
    if summary["idle_estimate"] is not None:
        print(f"device waiting for the host: {100 * summary['idle_estimate']:.1f}% of the steps")
    device = summary["device"]
    if device is not None:
        print(
            f"CUDA events over {device['steps']} steps: device idle between steps "
            f"{100 * device['idle_between_steps']:.1f}%, median gap {device['gap_median_us']:.1f}"
            f" us, median step span {device['span_median_us']:.1f} us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
