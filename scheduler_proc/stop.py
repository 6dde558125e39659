"""Finish checks for a run of new tokens (one, or several with speculation). Pure.

A run is cut at its first finishing token: EOS (unless ignore_eos), a `stop_token_ids` entry,
the `max_new_tokens` / context limit, or the token that completes a stop string. The finishing
token itself is kept (like SGLang; the detokenizer hides stop tokens and trims stop strings);
tokens after it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from aerie.messages import FinishReason
from scheduler_proc.request import Request

# Stop-string window: this many tokens more than the longest stop string has characters.
_STOP_WINDOW_SLACK = 4


class FinishChecker:
    def __init__(
        self,
        eos_token_ids: tuple[int, ...] | list[int],
        decode_tokens: Callable[[list[int]], str] | None = None,
    ) -> None:
        """The max_new_tokens / context limit is the request's own `max_output_len`."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.decode_tokens = decode_tokens

    def stop_ids(self, req: Request) -> frozenset[int]:
        """The token ids that end `req` (stop_token_ids, plus EOS unless ignore_eos); built
        once per request, not per step."""
        if req.stop_ids is None:
            ids = set(req.sampling.stop_token_ids)
            if not req.sampling.ignore_eos:
                ids.update(self.eos_token_ids)
            req.stop_ids = frozenset(ids)
        return req.stop_ids

    def check(self, req: Request, new_ids: list[int]) -> tuple[int, FinishReason | None]:
        """How many of `new_ids` to keep, and the finish reason if the run ends it.

        Does not mutate `req`; `req.output_ids` must not yet contain `new_ids`.
        """
        # Most runs end nothing: below the length limit, no stop id, no stop string to look
        # for. Tell them apart with one comparison and one set test (this runs for every
        # request each step); `_check_run` cuts the others.
        if (
            len(req.output_ids) + len(new_ids) < req.max_output_len
            and not (req.sampling.stop and self.decode_tokens is not None)
            and self.stop_ids(req).isdisjoint(new_ids)
        ):
            return len(new_ids), None
        return self._check_run(req, new_ids)

    def _check_run(self, req: Request, new_ids: list[int]) -> tuple[int, FinishReason | None]:
        """`check` for any run: where it is cut and why."""
        sampling = req.sampling
        limit = min(len(new_ids), max(req.max_output_len - len(req.output_ids), 0))
        num_keep, finish = limit, None
        stop_ids = self.stop_ids(req)
        if stop_ids and limit:
            hit = next((i for i, t in enumerate(new_ids[:limit]) if t in stop_ids), None)
            if hit is not None:
                num_keep, finish = hit + 1, FinishReason("stop", matched=new_ids[hit])
        if sampling.stop and self.decode_tokens is not None and num_keep:
            found = self._find_stop_string(req, new_ids[:num_keep])
            if found is not None:
                num_keep, finish = found[0], FinishReason("stop", matched=found[1])
        if finish is None and len(req.output_ids) + num_keep >= req.max_output_len:
            finish = FinishReason("length")  # max_new_tokens or the context length
        return num_keep, finish

    def _find_stop_string(self, req: Request, new_ids: list[int]) -> tuple[int, str] | None:
        """(tokens to keep, matched string) for the first new token completing a stop string."""
        assert self.decode_tokens is not None
        stops = req.sampling.stop
        window = max(len(s) for s in stops) + _STOP_WINDOW_SLACK
        prev_ids = req.output_ids[-window:] if window else []
        prev_text = self.decode_tokens(prev_ids) if prev_ids else ""

        def match(num_new: int) -> str | None:
            text = self.decode_tokens(prev_ids + new_ids[:num_new])
            for stop in stops:
                if stop and text.find(stop, max(0, len(prev_text) - len(stop) + 1)) != -1:
                    return stop
            return None

        if match(len(new_ids)) is None:
            return None
        for num_new in range(1, len(new_ids) + 1):
            stop = match(num_new)
            if stop is not None:
                return num_new, stop
        return None
