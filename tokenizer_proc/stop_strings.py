"""Stop-string handling on decoded text: where a finished text ends, and what may be shown yet.

Two pure functions on strings. The scheduler decides *that* a request stopped on a string; the
detokenizer only makes the text agree: text from the first occurrence of the stop string on is
never shown, and while a request runs, a tail that could still grow into a stop string is held
back until it cannot.
"""

from __future__ import annotations


def find_safe_end(text: str, stops: list[str]) -> int:
    """How many leading chars of the not-yet-shown `text` may be shown now.

    The result stops before the first full occurrence of any stop string, and before the
    longest suffix of what remains that is a proper prefix of some stop string (it might
    complete into one with the next tokens). Callers show text only up to this point, so no
    occurrence of a stop string ever starts inside text already shown.
    """
    if not stops:
        return len(text)
    end = len(text)
    for stop in stops:
        index = text.find(stop, 0, end + len(stop) - 1)
        if index >= 0:
            end = index
    return end - held_suffix_len(text[:end], stops)


def held_suffix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def trim_at_stop(text: str, matched: str) -> str:
    """The not-yet-shown `text` cut before the first occurrence of `matched` (else unchanged).

    Only unshown text is searched, so shown text stays final even if `matched` was not among
    the stop strings held back for.
    """
    index = text.find(matched) if matched else -1
    return text if index < 0 else text[:index]
