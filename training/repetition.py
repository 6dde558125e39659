"""How much an answer repeats itself: the share of its tokens that end an n-gram already seen
earlier in the same answer. A small target decoding greedily falls into loops late in long
answers, and repeated text is easy for a draft to predict, so accept lengths are read beside
this share (the offline estimate and the served benchmark both report it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPEAT_NGRAM = 8


def repeated_share(responses: Iterable[Sequence[int]], n: int = REPEAT_NGRAM) -> float:
    """Over all the responses' tokens: the share that ends an n-gram seen earlier in the same
    response (0 for no tokens)."""
    repeated = total = 0
    for response in responses:
        tokens = list(response)
        seen: set[tuple[int, ...]] = set()
        for end in range(n, len(tokens) + 1):
            gram = tuple(tokens[end - n : end])
            repeated += gram in seen
            seen.add(gram)
        total += len(tokens)
    return repeated / max(total, 1)
