"""What one ZMQ client connection may cost the frontend beyond its running requests. Pure.

`ErrorReplyBudget`: a token bucket of error replies per connection, the one thing a flood of
bad frames could multiply; past it bad frames are dropped unanswered. `FrameLog` sums the
per-frame warnings into a line every `LOG_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

ERROR_REPLY_BURST = 64
ERROR_REPLIES_PER_S = 64.0
MAX_TRACKED_CONNECTIONS = 4096  # error buckets kept; the least recently used goes first
LOG_INTERVAL_S = 5.0


class ErrorReplyBudget:
    """Per-connection token buckets of error replies (see the module docstring). At most
    `max_tracked` connections are tracked; forgetting one only refills its bucket."""

    def __init__(
        self,
        burst: int = ERROR_REPLY_BURST,
        per_s: float = ERROR_REPLIES_PER_S,
        max_tracked: int = MAX_TRACKED_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.per_s, self.max_tracked = burst, per_s, max_tracked
        self._clock = clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # tokens, time

    def take(self, identity: bytes) -> bool:
        """Spend one error reply of this connection's budget; False when none is left."""
        now = self._clock()
        tokens, stamp = self._buckets.pop(identity, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - stamp) * self.per_s)
        allowed = tokens >= 1.0
        self._buckets[identity] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.max_tracked:
            self._buckets.popitem(last=False)
        return allowed

    def forget(self, identity: bytes) -> None:
        self._buckets.pop(identity, None)

    def __len__(self) -> int:
        return len(self._buckets)


class FrameLog:
    """Rate-limited warnings about client frames: after a quiet interval the first one is
    logged as it is; later ones are counted by kind and summed up in one line when the
    interval ends (by the next `warn`, or by `flush_due`, which the frontend calls
    periodically)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self.interval_s, self._clock = logger, interval_s, clock
        self._counts: Counter[str] = Counter()
        self._num_unanswered = 0
        self._quiet_until = -float("inf")

    def warn(self, kind: str, message: str, answered: bool = True) -> None:
        """kind: what happened, as a plural noun phrase ("malformed frames"); message: this
        occurrence; answered: whether the client was sent an error reply."""
        now = self._clock()
        if not self._counts and now >= self._quiet_until:
            self._log.warning("%s%s", message, "" if answered else " (not answered)")
            self._quiet_until = now + self.interval_s
            return
        self._counts[kind] += 1
        self._num_unanswered += not answered
        self.flush_due(now)

    def flush_due(self, now: float | None = None) -> None:
        """Log the summary of the interval if it has ended."""
        now = self._clock() if now is None else now
        if not self._counts or now < self._quiet_until:
            return
        kinds = ", ".join(f"{n} {kind}" for kind, n in self._counts.most_common())
        self._log.warning(
            "ZMQ clients in the last %.0f s: %s; %d frames dropped unanswered (their "
            "connection's error reply budget was spent)",
            self.interval_s,
            kinds,
            self._num_unanswered,
        )
        self._counts.clear()
        self._num_unanswered = 0
        self._quiet_until = now + self.interval_s
