"""What the soak sends (`tools/soak.py`): the seeded mix of request kinds, the random prompt
pool, and where a stop string cuts a greedy reference."""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_NEW = 40  # the reference outputs' length; every request asks for 1..MAX_NEW tokens
NUM_PROMPTS = 48
KIND_WEIGHTS = {
    "http": 3,
    "http_stream": 2,
    "openai": 1,
    "zmq": 2,
    "zmq_stream": 2,
    "stop": 2,
    "sampled": 1,
    "http_disconnect": 1,
    "http_timeout": 1,
    "zmq_abort": 1,
    "zmq_timeout": 1,
}
GREEDY_KINDS = ("http", "http_stream", "openai", "zmq", "zmq_stream", "stop")


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str
    prompt: int  # index into the prompt pool
    max_new: int
    stop: str | None = None


NUM_STEMS = 4


def random_prompts(rng: random.Random, vocab: int, count: int) -> list[list[int]]:
    """count prompts of 1..60 ids from the non-special range [3, vocab). A third are random
    throughout; the rest start with one of NUM_STEMS shared stems (of 4..36 ids), so that the
    prefix cache matches parts of prompts and splits its tree, not only whole repeats."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    stems = [ids(rng.randint(4, 36)) for _ in range(NUM_STEMS)]
    prompts = []
    for index in range(count):
        if index % 3 == 0:
            prompts.append(ids(rng.randint(1, 60)))
        else:
            stem = rng.choice(stems)
            prompts.append(stem[: rng.randint(1, len(stem))] + ids(rng.randint(1, 24)))
    return prompts


def plan_requests(
    rng: random.Random, count: int, references: list[list[int]], decode
) -> list[Planned]:
    """The seeded mix. A stop request's string is the text of one reference token (one that
    decodes to clean text), so that it certainly completes within the request's length."""
    kinds, weights = zip(*KIND_WEIGHTS.items(), strict=True)
    planned = []
    for index in range(count):
        kind = rng.choices(kinds, weights)[0]
        prompt, max_new = rng.randrange(len(references)), rng.randint(1, MAX_NEW)
        stop = None
        if kind == "stop":
            position = rng.randrange(max_new)
            stop = decode(references[prompt][position : position + 1])
            if not stop.strip() or "\ufffd" in stop:
                kind, stop = "http", None
        planned.append(Planned(index, kind, prompt, max_new, stop))
    return planned


def expected_stop(reference: list[int], stop: str, decode) -> int:
    """How many tokens a greedy request keeps: up to the first that completes `stop`."""
    for n in range(1, len(reference) + 1):
        if stop in decode(reference[:n]):
            return n
    raise AssertionError(f"{stop!r} never completes in the reference")
