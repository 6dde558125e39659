"""Plot a `bench_spec_serving` result: speculation's gain over plain serving, and its acceptance.

    python3 benchmarks/plot_spec_serving.py results.json --out spec_serving.png

Left: tokens/s over plain's against concurrency; right: acceptance per draft position. Needs
matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os


def sum_positions(deltas: list[list[float]]) -> list[float]:
    """Per-position sums of several runs' counter deltas (a later run may count more positions:
    the server's list grows when a position is first accepted)."""
    totals = [0.0] * max(map(len, deltas), default=0)
    for delta in deltas:
        for k, d in enumerate(delta):
            totals[k] += d
    return totals


def lines(report: dict) -> dict[tuple[str, float], list[dict]]:
    """(server, temperature) -> its rows by concurrency, speculative servers only, first turns
    (rows of reports without turns are first turns)."""
    out: dict[tuple[str, float], list[dict]] = {}
    for row in report["rows"]:
        if row["server"] != "plain" and row.get("turn", 1) == 1:
            out.setdefault((row["server"], row["temperature"]), []).append(row)
    return {key: sorted(rows, key=lambda r: r["concurrency"]) for key, rows in out.items()}


def title(report: dict) -> str:
    """The model, the machine and the date (where the report has them)."""
    parts = [
        os.path.basename(report["model_path"].rstrip("/")),
        report.get("machine"),
        report.get("date"),
    ]
    return ", ".join(part for part in parts if part)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, temperature), rows in lines(report).items():
        style, label = "-" if temperature == 0 else "--", f"{name}, T={temperature:g}"
        timed = [r for r in rows if r["ratio_to_plain"] is not None]
        xs, ys = [r["concurrency"] for r in timed], [r["ratio_to_plain"] for r in timed]
        left.plot(xs, ys, marker="o", linestyle=style, label=label)
        totals = sum_positions([r["accepted_delta"] for r in rows])
        if totals and totals[0]:
            accept = sum(totals) / totals[0]
            acceptance = [t / totals[0] for t in totals[1:]]
            right.plot(
                range(1, len(totals)),
                acceptance,
                marker="o",
                linestyle=style,
                label=f"{label} (accept length {accept:.2f})",
            )
    left.axhline(1.0, color="grey", linewidth=1, linestyle=":", label="plain")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent streams")
    left.set_ylabel("output tokens/s over plain's")
    right.set_xlabel("draft position k")
    right.set_ylabel("verify steps that accepted draft token k")
    right.set_ylim(0, 1.05)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="bench_spec_serving's --output JSON")
    parser.add_argument("--out", default="spec_serving.png")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        plot(json.load(f), args.out)
    return args.out


if __name__ == "__main__":
    print(main())
