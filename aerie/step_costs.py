"""`StepCosts`: what a decode step costs, plain and speculative, by batch size.

The GPU worker measures them at start-up (`gpu_worker.tooling.step_costs`); they travel as JSON (the
worker's ready report, then `--speculative-step-costs` of the scheduler's configuration, and
/server_info), and adaptive speculation (`scheduler_proc.adaptive`) compares them.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

VARIANTS = ("greedy", "sampled")  # a bare argmax; the sampling stages (draws, penalties)


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds per step by batch bucket: plain[variant][i] and speculative[variant][i] for
    a batch of up to buckets[i] requests (larger batches: the last bucket's ratio)."""

    buckets: tuple[int, ...]
    plain: dict[str, tuple[float, ...]]
    speculative: dict[str, tuple[float, ...]]

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"step cost buckets must be increasing, got {self.buckets}")
        for table in (self.plain, self.speculative):
            for variant in VARIANTS:
                times = table.get(variant)
                if times is None or len(times) != len(self.buckets):
                    raise ValueError(f"step costs need {len(self.buckets)} {variant} times")
                if min(times) <= 0:
                    raise ValueError(f"step costs must be positive, got {times}")

    def break_even(self, batch_size: int, sampled: bool) -> float:
        """Tokens per request an iteration must emit to match plain decoding at this batch."""
        i = min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)
        variant = "sampled" if sampled else "greedy"
        return self.speculative[variant][i] / self.plain[variant][i]

    def to_json(self) -> str:
        return json.dumps(
            {
                "buckets": list(self.buckets),
                "plain_ms": self.plain,
                "speculative_ms": self.speculative,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> StepCosts:
        """Parse `--speculative-step-costs` (raises ValueError saying what is wrong)."""
        try:
            raw = json.loads(text)
            return cls(
                tuple(int(b) for b in raw["buckets"]),
                {v: tuple(float(t) for t in raw["plain_ms"][v]) for v in VARIANTS},
                {v: tuple(float(t) for t in raw["speculative_ms"][v]) for v in VARIANTS},
            )
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                '--speculative-step-costs must be JSON like {"buckets": [1, 2], "plain_ms": '
                '{"greedy": [..], "sampled": [..]}, "speculative_ms": {...}}: '
                f"{type(e).__name__} {e}"
            ) from None
