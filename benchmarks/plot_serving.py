"""Plot served throughput and inter-token latency against concurrency, overlap on and off.

    python3 benchmarks/plot_serving.py docs/results/serving_plain_h100.json --out docs

Latency is each stream's median TPOT: at high concurrency chunks arrive in bursts, so raw
inter-chunk gaps mislead. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os


def label(row: dict) -> str:
    """A line's legend: the algorithm, its draft (a speculative row must say which: a line
    drawn with a random-weight draft, which is almost never accepted, reads as "speculation is
    slower" unless the legend says so) and the overlap schedule."""
    name = row["algorithm"]
    if name != "plain":
        if not row.get("draft"):
            raise ValueError(f"a {name} row needs a 'draft' field saying which draft it ran")
        name = f"{name} ({row['draft']})"
    return f"{name}, overlap {'on' if row['overlap'] else 'off'}"


def series(rows: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (concurrencies, values), sorted by concurrency."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        if not isinstance(row["concurrency"], int):
            continue
        label_ = label(row)
        xs, ys = out.setdefault(label_, ([], []))
        xs.append(row["concurrency"])
        ys.append(row[key])
    for xs, ys in out.values():
        order = sorted(range(len(xs)), key=xs.__getitem__)
        xs[:], ys[:] = [xs[i] for i in order], [ys[i] for i in order]
    return out


def plot(summary: dict, key: str, ylabel: str, path: str, reference: float | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series(summary["rows"], key).items():
        ax.plot(xs, ys, marker="o", linestyle="-" if "overlap on" in name else "--", label=name)
    if reference is not None:
        ax.axhline(
            reference,
            color="grey",
            linewidth=1,
            linestyle=":",
            label="compiled static-KV loop, batch 64",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(ylabel)
    ax.set_title(summary.get("machine", ""), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary")
    parser.add_argument("--out", default="docs", help="directory for the PNG files")
    args = parser.parse_args(argv)
    with open(args.summary) as f:
        summary = json.load(f)
    reference = summary.get("baseline_compiled_tok_s", {}).get("64")
    paths = [
        os.path.join(args.out, "serving_throughput.png"),
        os.path.join(args.out, "serving_itl.png"),
    ]
    plot(summary, "output_tok_s", "output tokens/s (all streams)", paths[0], reference)
    plot(summary, "tpot_median_ms", "inter-token latency per stream (median TPOT, ms)", paths[1])
    return paths


if __name__ == "__main__":
    print("\n".join(main()))
