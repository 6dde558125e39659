"""Adaptive speculation: each decode step either speculates or decodes plainly, whichever is
expected to produce more tokens per second for that batch.

What it compares, for a batch of b requests:
- the step costs the GPU worker measured at start-up (`StepCosts`): per CUDA-graph batch
  bucket, the time of a plain decode step and of a speculative iteration, greedy and sampled;
- the acceptance: each request's running estimate of the tokens an iteration emits for it (the
  mean of its accept lengths, starting from its kind's), and one per kind over all requests,
  which stands in for a request not observed yet.
The batch speculates when its mean estimate reaches the break-even t_spec(b) / t_plain(b):
an iteration must emit that many tokens per request to be as fast as plain decoding. A batch of
one is one request's own choice, so a stream whose draft keeps missing stops drafting.

While plain decoding is chosen nothing is observed, so every `probe_interval` plain steps a
probe of PROBE_ITERATIONS iterations runs anyway. The draft is not run on plainly decoded
positions: the first iteration after plain steps drafts from the state the draft had before
them, and the scheduler does not learn from it; its draft extend brings the state up to date,
and the second is observed. The interval starts at FIRST_PROBE and doubles each time a probe
confirms plain decoding, up to MAX_PROBE: a probe costs about two plain steps, 0.8% once in
256 steps. A batch whose drafts start agreeing again (a new request, code after prose)
switches back. The draft's KV at plainly decoded positions stays stale after speculation
resumes: that costs acceptance, which the estimates see.

Exactness does not depend on the choice: a plain step is the target's own decode step, and an
iteration emits only tokens the target verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aerie.messages import SamplingParams
from aerie.step_costs import StepCosts

FIRST_PROBE, MAX_PROBE = 32, 256  # plain steps between two probes
PROBE_ITERATIONS = 2  # the first after plain steps catches the draft up, the second measures
# A request's estimate is the mean of its observed accept lengths, its kind's estimate counted
# as PRIOR_ITERATIONS observations. A running mean, not a moving average: a request that goes
# plain rarely comes back (its draft's KV goes stale), so one bad patch must not send it there.
# One iteration's accept length spreads over 1..S+1 (a standard deviation of about 1.2 at S =
# 3), so a moving average of weight 0.3 crossed a 5% hysteresis band within about ten
# iterations for every request of a draft accepting 2.3 against a break-even of 1.8.
PRIOR_ITERATIONS = 8
# From LONG_RUN - PRIOR_ITERATIONS observations on, each new one weighs 1 / LONG_RUN (a moving
# average that long), so a long request still follows its text (code after prose, or a draft
# that stops agreeing).
LONG_RUN = 32
# While speculating, plain decoding takes over only below (1 - HYSTERESIS) x the break-even:
# a switch costs (the first iteration after plain steps drafts from a stale state, and the
# draft's KV stays stale at the plainly decoded positions).
HYSTERESIS = 0.05
OVERALL_WEIGHT = 0.05  # ... in the estimate over all requests


def samples(params: SamplingParams) -> bool:
    """Whether a request's step runs the sampling stages (drawn tokens or penalties) rather
    than a bare argmax: the sampled step costs."""
    return params.draws or params.penalised


def kind(params: SamplingParams) -> tuple:
    """What a request's acceptance is learnt with: its sampling settings. Drafts agree with a
    greedy target far more than with one sampled at temperature 1, so a new request starts
    from what requests of its own kind accepted. The first element says whether it samples."""
    if not samples(params):
        return (False,)
    return (
        True,
        round(params.temperature, 2),
        round(params.top_p, 2),
        params.top_k,
        round(params.min_p, 2),
    )


@dataclass
class Decision:
    """One step's choice and why: the batch's mean estimate against the break-even."""

    speculate: bool
    expected: float | None  # mean tokens per iteration expected (None: nothing observed yet)
    break_even: float
    probe: bool = False


@dataclass
class AdaptiveSpeculation:
    """The per-step choice (see the module docstring)."""

    costs: StepCosts
    # Running accept length over all requests of each kind (`kind`): a request not observed
    # yet starts from its kind's.
    overall: dict[tuple, float] = field(default_factory=dict)
    probe_interval: int = FIRST_PROBE
    plain_run: int = 0  # plain steps since the last iteration
    probe_left: int = 0  # iterations of the current probe still to plan
    last: Decision | None = None
    speculating: bool = True  # the last choice but for probes
    estimates: dict[str, float] = field(default_factory=dict)  # rid -> its running estimate
    observed: dict[str, int] = field(default_factory=dict)  # rid -> iterations observed

    def choose(self, rids: list[str], kinds: list[tuple]) -> Decision:
        """Speculate for this batch of requests (True) or decode plainly (False); kinds: per
        request, its `kind`."""
        break_even = self.costs.break_even(len(rids), any(k[0] for k in kinds))
        estimates = [
            self.estimates.get(rid, self.overall.get(k)) for rid, k in zip(rids, kinds, strict=True)
        ]
        if None in estimates:  # a request of a kind never observed: speculate to learn
            decision = Decision(True, None, break_even)
        else:
            expected = sum(estimates) / len(estimates)
            threshold = break_even * (1 - HYSTERESIS) if self.speculating else break_even
            decision = Decision(expected >= threshold, expected, break_even)
        self.speculating = decision.speculate
        if decision.speculate:
            self.plain_run, self.probe_interval, self.probe_left = 0, FIRST_PROBE, 0
        elif self.probe_left > 0 or self.plain_run >= self.probe_interval:
            if self.probe_left == 0:  # a new probe
                self.probe_left = PROBE_ITERATIONS
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE)
            decision.speculate = decision.probe = True
            self.plain_run, self.probe_left = 0, self.probe_left - 1
        else:
            self.plain_run += 1
        self.last = decision
        return decision

    def observe(self, rid: str, accept_length: int, kind: tuple = (False,)) -> None:
        """One iteration emitted accept_length tokens for request rid (of this `kind`)."""
        overall = self.overall.get(kind, accept_length)
        old = self.estimates.get(rid, overall)
        n = self.observed[rid] = self.observed.get(rid, 0) + 1
        self.estimates[rid] = old + (accept_length - old) / min(PRIOR_ITERATIONS + n, LONG_RUN)
        self.overall[kind] = overall + OVERALL_WEIGHT * (accept_length - overall)

    def forget(self, rid: str) -> None:
        """A request finished (or was retracted and will start afresh)."""
        self.estimates.pop(rid, None)
        self.observed.pop(rid, None)
