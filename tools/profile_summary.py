"""Summarise `py-spy record --format raw --threads --idle` files: where each process's host time
goes.

    python tools/profile_summary.py --rate 250 --seconds 10 spy_scheduler.txt spy_worker.txt ...

For every file and every Python thread in it (the busiest first): the share of wall time the
thread was sampled (`--idle` samples a waiting thread too, so a main thread reads about 100%),
the share spent waiting (the leaf frame is a known blocking call: a socket poll, an event-loop
select, a CUDA event wait, a sleep), then the leaf frames and the inclusive frames with the
largest shares. Shares are of wall time: samples / (rate x seconds).
"""

from __future__ import annotations

import argparse
import collections
import os

# Leaf functions that block in C: socket polls and receives, selects, CUDA waits, sleeps, idle
# pool threads, and `run` (an event loop's or a C helper thread's own loop: for uvloop this
# also holds the C-level transport work, so an asyncio process's "waiting" is an upper bound).
WAIT_NAMES = {
    "poll",
    "select",
    "_run_once",
    "synchronize",
    "sleep",
    "wait",
    "recv",
    "_worker",
    "run",
}


def read_threads(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """thread label -> [(frames root first, samples)]."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            label = frames[0] if frames[0].startswith("thread") else "thread"
            threads[label].append((frames[1:] if label != "thread" else frames, int(count)))
    return threads


def is_wait(leaf: str) -> bool:
    return leaf.split(" (", 1)[0] in WAIT_NAMES


def summarise(path: str, wall_samples: float, top: int) -> list[str]:
    lines = [f"== {os.path.basename(path)}"]
    threads = read_threads(path)
    order = sorted(threads, key=lambda t: -sum(n for _, n in threads[t]))
    for label in order[:3]:
        stacks = threads[label]
        total = sum(n for _, n in stacks)
        waiting = sum(n for frames, n in stacks if frames and is_wait(frames[-1]))
        busy = total - waiting
        lines.append(
            f" {label}: sampled {total / wall_samples:.0%} of wall, waiting "
            f"{waiting / wall_samples:.0%}, busy {busy / wall_samples:.0%}"
        )
        own: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            if not frames:
                continue
            own[frames[-1]] += n
            for frame in set(frames):
                incl[frame] += n
        for frame, n in own.most_common(top):
            lines.append(f"   self {n / wall_samples:6.1%}  {frame[:120]}")
        shown = 0
        for frame, n in incl.most_common():
            if n >= 0.97 * total:  # the bootstrap frames every sample has
                continue
            lines.append(f"   incl {n / wall_samples:6.1%}  {frame[:120]}")
            shown += 1
            if shown == top * 2:
                break
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rate", type=float, required=True, help="py-spy --rate")
    parser.add_argument("--seconds", type=float, required=True, help="py-spy --duration")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.files:
        print("\n".join(summarise(path, args.rate * args.seconds, args.top)))


if __name__ == "__main__":
    main()
