"""Adaptive speculation: each decode step either speculates or decodes plainly, whichever is
expected to produce more tokens per second for that batch.

What it compares, for a batch of b requests:
- the step costs the GPU worker measured at start-up (`StepCosts`): per CUDA-graph batch
  bucket, the time of a plain decode step and of a speculative iteration, greedy and sampled;
- the acceptance: each request's running estimate of the tokens an iteration emits for it (the
  mean of its accept lengths, starting from its kind's), and per kind the mean and spread over
  all requests, which stand in for a request not observed yet.
The batch speculates when its mean estimate, plus one standard error of that mean, reaches the
break-even t_spec(b) / t_plain(b): an iteration must emit that many tokens per request to be as
fast as plain decoding. The standard error gives an estimate made of few iterations the benefit
of the doubt: one iteration emits 1..S+1 tokens (a standard deviation of about 1.2 at S = 3),
and a draft agrees very differently from one chat prompt to the next, so the first request of
a server, or the first iterations of a new one, say little about the next. A batch of one is
one request's own choice, so a stream whose draft keeps missing stops drafting once its own
iterations show it; a batch of many has a small standard error and follows its mean.

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

import math
from dataclasses import dataclass, field

from aerie.messages import SamplingParams
from aerie.step_costs import StepCosts

FIRST_PROBE, MAX_PROBE = 32, 256  # plain steps between two probes
PROBE_ITERATIONS = 2  # the first after plain steps catches the draft up, the second measures
# A request's estimate is the mean of its observed accept lengths, its kind's mean counted as
# PRIOR_ITERATIONS observations (fewer while the kind has seen fewer). A running mean, not a
# moving average: one iteration's accept length spreads over 1..S+1, so a moving average of
# weight 0.3 crossed a 5% hysteresis band within about ten iterations for every request of a
# draft accepting 2.3 against a break-even of 1.8.
PRIOR_ITERATIONS = 8
# From LONG_RUN - PRIOR_ITERATIONS observations on, each new one weighs 1 / LONG_RUN (a moving
# average that long), so a long request still follows its text (code after prose, or a draft
# that stops agreeing).
LONG_RUN = 32
# While speculating, plain decoding takes over only below (1 - HYSTERESIS) x the break-even:
# a switch costs (the first iteration after plain steps drafts from a stale state, and the
# draft's KV stays stale at the plainly decoded positions).
HYSTERESIS = 0.05
# A kind's statistics stand for the next request, so they span many: a plain mean over their
# first 1 / OVERALL_WEIGHT iterations, then a moving one that long (about eight requests of 256
# tokens at one stream). A weight of 0.05 tracked the last request alone at one stream, and a
# request that started badly sent the next one to plain decoding.
OVERALL_WEIGHT = 1 / 512


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
    """One step's choice and why: the batch's mean estimate, give or take its standard error,
    against the break-even."""

    speculate: bool
    expected: float | None  # mean tokens per iteration expected (None: nothing observed yet)
    break_even: float
    probe: bool = False
    error: float = 0.0  # the standard error of `expected`


@dataclass
class KindStats:
    """The accept lengths of one kind's iterations, over all requests: a plain mean and
    variance over the first 1 / OVERALL_WEIGHT, then moving ones of that weight."""

    count: int = 0
    mean: float = 0.0
    variance: float = 0.0

    def add(self, accept_length: float) -> None:
        self.count += 1
        weight = max(1 / self.count, OVERALL_WEIGHT)
        delta = accept_length - self.mean
        self.mean += weight * delta
        self.variance = (1 - weight) * (self.variance + weight * delta * delta)

    def estimate(self) -> RequestEstimate:
        """What a request of this kind not observed yet is expected to accept."""
        return RequestEstimate(self.mean, min(PRIOR_ITERATIONS, self.count))


@dataclass
class RequestEstimate:
    """One request's expected accept length: the mean of its kind's mean, counted as `prior`
    iterations, and its own `count` iterations; a moving average of weight 1 / LONG_RUN once
    they add up to LONG_RUN."""

    mean: float
    prior: int
    count: int = 0

    def add(self, accept_length: float) -> None:
        self.count += 1
        self.mean += (accept_length - self.mean) / min(self.prior + self.count, LONG_RUN)

    @property
    def weight(self) -> int:
        """The iterations the estimate is worth: its variance is one iteration's over this. A
        moving average of weight 1 / LONG_RUN is worth 2 * LONG_RUN - 1."""
        return min(self.prior + self.count, 2 * LONG_RUN - 1)


@dataclass
class AdaptiveSpeculation:
    """The per-step choice (see the module docstring)."""

    costs: StepCosts
    # The most tokens an iteration emits (S + 1): an accept length's largest possible spread,
    # (max_accept - 1) / 2, stands in for a kind's until it has been observed.
    max_accept: int = 4
    # Accept lengths over all requests of each kind (`kind`): a request not observed yet
    # starts from its kind's mean.
    kinds: dict[tuple, KindStats] = field(default_factory=dict)
    requests: dict[str, RequestEstimate] = field(default_factory=dict)  # the observed ones
    probe_interval: int = FIRST_PROBE
    plain_run: int = 0  # plain steps since the last iteration
    probe_left: int = 0  # iterations of the current probe still to plan
    last: Decision | None = None
    speculating: bool = True  # the last choice but for probes

    def choose(self, rids: list[str], kinds: list[tuple]) -> Decision:
        """Speculate for this batch of requests (True) or decode plainly (False); kinds: per
        request, its `kind`."""
        break_even = self.costs.break_even(len(rids), any(k[0] for k in kinds))
        unseen = (
            r not in self.requests and k not in self.kinds for r, k in zip(rids, kinds, strict=True)
        )
        if any(unseen):
            decision = Decision(True, None, break_even)  # a kind never observed: learn it
        else:
            expected, error = self._batch_estimate(rids, kinds)
            threshold = break_even * (1 - HYSTERESIS) if self.speculating else break_even
            decision = Decision(expected + error >= threshold, expected, break_even, error=error)
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

    def _batch_estimate(self, rids: list[str], kinds: list[tuple]) -> tuple[float, float]:
        """The batch's mean estimate and its standard error (each request's estimate has
        variance spread / weight, the spread its kind's). Runs every decode step: per kind
        once, per request a lookup."""
        total = variance = 0.0
        per_kind: dict[tuple, tuple[float, int, float]] = {}
        for rid, k in zip(rids, kinds, strict=True):
            if k not in per_kind:
                stats = self.kinds.get(k) or KindStats()
                prior = max(min(PRIOR_ITERATIONS, stats.count), 1)
                per_kind[k] = (stats.mean, prior, self._spread(stats))
            mean, prior, spread = per_kind[k]
            estimate = self.requests.get(rid)
            if estimate is None:
                total += mean
                variance += spread / prior
            else:
                total += estimate.mean
                variance += spread / estimate.weight
        return total / len(rids), math.sqrt(variance) / len(rids)

    def _spread(self, stats: KindStats) -> float:
        """A kind's variance of one iteration's accept length: its observed variance, with the
        largest possible one counted as PRIOR_ITERATIONS observations (a handful of iterations
        that all missed say little about the spread)."""
        prior = ((self.max_accept - 1) / 2) ** 2
        return (PRIOR_ITERATIONS * prior + stats.count * stats.variance) / (
            PRIOR_ITERATIONS + stats.count
        )

    def observe(self, rid: str, accept_length: int, kind: tuple = (False,)) -> None:
        """One iteration emitted accept_length tokens for request rid (of this `kind`)."""
        stats = self.kinds.get(kind)
        if stats is None:
            stats = self.kinds[kind] = KindStats()
        estimate = self.requests.get(rid)
        if estimate is None:
            estimate = self.requests[rid] = stats.estimate()
        estimate.add(accept_length)
        stats.add(accept_length)

    def forget(self, rid: str) -> None:
        """A request finished (or was retracted and will start afresh)."""
        self.requests.pop(rid, None)
