"""Explain where two runs of the same prompts part: a near-tie, or a bug?

Greedy decoding in bf16 is not batch invariant: a matmul or an attention split summed in another
order (another batch size, another number of query tokens, a speculative verify) rounds a
logit differently, and where the top two logits are within rounding of each other the argmax
may flip; from there the two answers go their own ways. A difference where the top logit
stands clear of the others is a bug. For each prompt whose two outputs differ this tool finds
the first differing position, runs the target model once in float32 (transformers) on the
prompt and the shared output before it, and reports the logits there: the top two, the two
tokens the runs picked, and the gap between the picks relative to the logit scale (the largest
absolute logit). A gap within `--tie` (default 2^-7: bf16 keeps 8 bits of significand) of the
scale is a near-tie; a larger one is marked SUSPECT and the exit status is 1. The report also
says whether the two picks are the reference's top two: rounding through a bf16 network can
move a logit by about 1% of the scale, so a pair of top-two picks just over the threshold is
still most likely a tie, where a bug tends to pick a token further down.

A run file is JSON: a list of {"prompt_ids": [...], "output_ids": [...], "error": ""} in the
same order in both files (the answers both hold are compared), as `bench_spec_serving.py
--save-outputs` writes them.

    python3 tools/divergence.py --model-path MODEL plain_c1.json plain_c16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TIE = 2.0**-7

Logits = Callable[[list[int]], torch.Tensor]  # token ids -> the next token's logits [V]


@dataclass(frozen=True)
class Divergence:
    """Where two outputs for one prompt part, and the reference's logits there."""

    index: int
    position: int  # of the first differing output token
    shared_share: float  # of the longer output, the share before the difference
    token_a: int | None  # None: that run's output ended there
    token_b: int | None
    logit_a: float | None
    logit_b: float | None
    top1: float
    top2: float
    scale: float  # the largest absolute logit
    relative_gap: float  # |logit_a - logit_b| (or top1 - top2 when a run ended) / scale
    near_tie: bool
    top_two_picked: bool  # the two picks are the reference's top two (a run that ended: False)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where a and b differ (one ending counts), None when equal."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(
    index: int,
    prompt: list[int],
    a: list[int],
    b: list[int],
    logits_of: Logits,
    tie: float = TIE,
) -> Divergence | None:
    """The divergence of outputs a and b of prompt, or None when they are equal."""
    position = first_difference(a, b)
    if position is None:
        return None
    logits = logits_of(prompt + a[:position]).float()
    best = torch.topk(logits, 2)
    top = best.values.tolist()
    scale = float(logits.abs().max())
    picks = [out[position] if position < len(out) else None for out in (a, b)]
    picked = [None if t is None else float(logits[t]) for t in picks]
    if None in picked:  # one run stopped (EOS, a length limit): compare the top two
        gap = top[0] - top[1]
    else:
        gap = abs(picked[0] - picked[1])
    relative = gap / scale if scale > 0 else 0.0
    return Divergence(
        index,
        position,
        position / max(len(a), len(b)),
        picks[0],
        picks[1],
        picked[0],
        picked[1],
        top[0],
        top[1],
        scale,
        relative,
        relative <= tie,
        set(picks) == set(best.indices.tolist()),
    )


def reference_logits(model_path: str, device: str) -> Logits:
    """The next token's float32 logits from transformers' model at model_path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.eval()

    @torch.inference_mode()
    def logits_of(ids: list[int]) -> torch.Tensor:
        out = model(torch.tensor([ids], device=device))
        return out.logits[0, -1].cpu()

    return logits_of


def compare(run_a: list[dict], run_b: list[dict], logits_of: Logits, tie: float = TIE) -> dict:
    """Every divergence between two runs of the same prompts (the answers both runs have: a
    run of more streams may hold more), and a summary. Answers either run failed (a
    non-empty "error") are counted apart; so are differences where one answer ended, which
    the reference cannot judge (a stop string or a length limit may have ended it)."""
    found: list[Divergence] = []
    failed = 0
    for index, (x, y) in enumerate(zip(run_a, run_b, strict=False)):
        if x["prompt_ids"] != y["prompt_ids"]:
            raise ValueError(f"answer {index} has different prompts in the two runs")
        if x.get("error") or y.get("error"):
            failed += 1
            continue
        d = explain(index, x["prompt_ids"], x["output_ids"], y["output_ids"], logits_of, tie)
        if d is not None:
            found.append(d)
    judged = [d for d in found if None not in (d.token_a, d.token_b)]
    compared = min(len(run_a), len(run_b)) - failed
    shares = [d.shared_share for d in found]
    return {
        "prompts": compared,
        "failed": failed,
        "identical": compared - len(found),
        "ended": len(found) - len(judged),
        "near_ties": sum(d.near_tie for d in judged),
        "suspects": sum(not d.near_tie for d in judged),
        "mean_shared_share": (sum(shares) + compared - len(found)) / max(compared, 1),
        "largest_relative_gap": max((d.relative_gap for d in judged), default=0.0),
        "outside_top_two": sum(not d.top_two_picked for d in judged),
        "tie": tie,
        "divergences": [asdict(d) for d in found],
    }


def compare_with(base: Path, runs: list[Path], logits_of: Logits, tie: float = TIE) -> dict:
    """Each run file's `compare` with the base run's, by run name (file stem); a run that
    cannot be compared (other prompts) gets {"error": why} instead."""
    base_run = json.loads(base.read_text())
    reports = {}
    for path in runs:
        try:
            reports[path.stem] = compare(base_run, json.loads(path.read_text()), logits_of, tie)
        except ValueError as e:
            reports[path.stem] = {"error": str(e)}
    return reports


def print_report(report: dict) -> None:
    if "error" in report:
        print(f"not compared: {report['error']}")
        return
    print(
        f"{report['identical']} / {report['prompts']} identical; {report['near_ties']} "
        f"near-ties, {report['suspects']} suspect (gap over {report['tie']:g} of the scale); "
        f"{report['outside_top_two']} picked outside the reference's top two; {report['ended']} "
        f"where one answer ended, {report['failed']} failed; mean share before the first "
        f"difference {report['mean_shared_share']:.0%}"
    )
    for d in report["divergences"]:
        verdict = "near-tie" if d["near_tie"] else "SUSPECT"
        if None in (d["token_a"], d["token_b"]):
            verdict = "one answer ended: not judged"
        picks = f"{d['token_a']} ({d['logit_a']}) vs {d['token_b']} ({d['logit_b']})"
        print(
            f"  answer {d['index']}: position {d['position']} ({d['shared_share']:.0%} in), "
            f"{picks}; top two {d['top1']:.4f} {d['top2']:.4f}, scale {d['scale']:.2f}, "
            f"gap {d['relative_gap']:.2e} of it: {verdict}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run_a", help="a run file (JSON list of prompt_ids / output_ids)")
    p.add_argument("run_b", help="the other run of the same prompts")
    p.add_argument("--model-path", required=True, help="the target model (HF directory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tie", type=float, default=TIE, help="largest near-tie gap / logit scale")
    p.add_argument("--output", default=None, help="write the report as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [json.loads(Path(path).read_text()) for path in (args.run_a, args.run_b)]
    report = compare(*runs, reference_logits(args.model_path, args.device), args.tie)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    print_report(report)
    return 1 if report["suspects"] else 0


if __name__ == "__main__":
    sys.exit(main())
