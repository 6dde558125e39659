"""Plot the `streams` suite: throughput, and the gap between a stream's events (median and
p99), against concurrent streams, one line per frontend count.

    python3 benchmarks/plot_streams.py docs/results/streams_h200.json --out docs

The input maps a frontend count to `bench_serving` summaries by concurrency (what
`python3 -m benchmarks streams` merges into serving_streams_f<N>.json, gathered into one file).
Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os


def series(runs: dict[str, dict], key: str, stat: str | None = None) -> tuple[list, list]:
    """(concurrencies, values) of one frontend count's runs, sorted by concurrency."""
    points = sorted(
        (int(conc), run[key] if stat is None else run[key][stat]) for conc, run in runs.items()
    )
    return [c for c, _ in points], [v for _, v in points]


def legend(frontends: str) -> str:
    return f"{frontends} frontend{'' if frontends == '1' else 's'}"


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", help="{frontends: {concurrency: summary}} JSON")
    p.add_argument("--out", default="docs", help="directory for the PNGs")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        results = json.load(f)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for frontends, runs in sorted(results.items(), key=lambda kv: int(kv[0])):
        ax.plot(*series(runs, "output_throughput"), marker="o", label=legend(frontends))
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s")
    ax.set_title("Served throughput by frontend count")
    ax.legend()
    written.append(os.path.join(args.out, "streams_throughput.png"))
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    for frontends, runs in sorted(results.items(), key=lambda kv: int(kv[0])):
        for stat, style in (("median", "-"), ("p99", "--")):
            xs, ys = series(runs, "itl_ms", stat)
            ax.plot(xs, ys, style, marker="o", label=f"{legend(frontends)}, {stat}")
    ax.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms")
    ax.set_title("Gap between a stream's events")
    ax.legend(fontsize=8)
    written.append(os.path.join(args.out, "streams_gap.png"))
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
