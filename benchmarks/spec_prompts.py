"""The prompts of the served speculation benchmark (`bench_spec_serving.py`), and the answers'
measures that acceptance is read beside: MT-bench first turns and the code prompts below,
alternately; second turns after the plain server's own greedy answer. Draft training drops
ShareGPT prompts that share a 13-word span with an MT-bench turn; the code prompts are not in
that filter, though none shares an 8-word span with the ShareGPT file training reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from benchmarks.serving_load import Payload, RequestResult

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = os.path.join(REPO_ROOT, "..", "shared", "data", "mt_bench_questions.jsonl")
MT_BENCH_URL = (
    "https://github.com/lm-sys/FastChat/blob/main/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
MT_BENCH, CODE = "mt-bench", "code"

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with type hints.",
    "Complete this function:\n\ndef merge_intervals(spans: list[tuple[int, int]]) -> list:\n"
    '    """Merge overlapping closed spans; return them sorted by their start."""\n',
    "Write a Python function that tells whether a sentence reads the same backwards, ignoring "
    "case, spaces and punctuation.",
    "Complete this function:\n\ndef chunked(items: list, size: int) -> list[list]:\n"
    '    """Split items into consecutive lists of at most `size` elements each."""\n',
    "Write a JavaScript debounce helper: calls that come less than `wait` ms apart run the "
    "wrapped function once, after the last of them.",
    "Write a SQL query listing the best-paid employee of every department, from the tables "
    "staff(id, name, pay, dept_id) and dept(id, title).",
    "Complete this function:\n\ndef parse_duration(text: str) -> int:\n"
    "    \"\"\"Seconds in a duration written like '1h30m', '45s' or '2m5s'.\"\"\"\n",
    "Write a Python class for a least-recently-used cache of fixed capacity whose get and put "
    "both take constant time.",
    "Write a Bash script that prints the ten biggest files below the directory named by its "
    "first argument, sizes in human-readable units.",
    "Complete this function:\n\ndef transpose(grid: list[list[int]]) -> list[list[int]]:\n"
    '    """Rows become columns: the transpose of a rectangular grid."""\n',
    "Write a Python generator yielding every prime below a limit, using a sieve.",
    "Write a Rust function that counts each word of a string and returns a HashMap from word "
    "to count.",
    "Complete this function:\n\ndef flatten(nested: list) -> list:\n"
    '    """All leaves of arbitrarily nested lists, in order, as one flat list."""\n',
    "Write a Python function that opens a CSV file and averages the numeric column whose name "
    "it is given, skipping blank cells.",
    "Write a C function that reverses a singly linked list in place and returns its new head.",
    "Complete this function:\n\ndef find_sorted(values: list[int], target: int) -> int:\n"
    '    """Index of target in the ascending list values by bisection, else -1."""\n',
    "Write a Python decorator that calls the decorated function again, at most three times in "
    "all, while it raises, sleeping one second between tries.",
    "Write a TypeScript type for a blog post (title, body, tags, optional publication date) and "
    "a function sorting posts newest first.",
    "Complete this function:\n\ndef roman_value(numeral: str) -> int:\n"
    '    """The integer a Roman numeral such as \'MCMXCIV\' stands for."""\n',
    "Write a Python function that sorts a list of words into groups of anagrams.",
]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # chat-templated, ending with the assistant's turn opened
    kind: str  # MT_BENCH or CODE
    turn: int = 1
    history_len: int = 0  # leading tokens that earlier turns of its chat already ran


def load_questions(path: str | None) -> list[list[str]]:
    """Each question's turns (MT-bench has two)."""
    if path is None:
        path = DEFAULT_PROMPTS
        if not os.path.isfile(path):
            raise SystemExit(
                f"no MT-bench questions at {os.path.normpath(path)}: pass --prompts "
                f"FILE.jsonl, e.g. FastChat's question.jsonl ({MT_BENCH_URL})"
            )
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line)["turns"] for line in f if line.strip()]
    if not questions or not all(questions):
        raise SystemExit(f"{path} holds no questions (or one without turns)")
    return questions


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def render(tokenizer, chat: list[dict], system: str = "", open_turn: bool = True) -> list[int]:
    if system:
        chat = [{"role": "system", "content": system}, *chat]
    return list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=open_turn, return_dict=False)
    )


def user_turn(tokenizer, text: str, system: str = "") -> list[int]:
    """A chat of one user turn (after a system message, if any), the assistant's turn opened."""
    return render(tokenizer, [{"role": "user", "content": text}], system)


def system_prompt(tokenizer, questions: list[list[str]], num_tokens: int) -> str:
    """A system message of about num_tokens tokens shared by every chat (0: none): the
    questions' own text, which no prompt of a run begins with."""
    if num_tokens <= 0:
        return ""
    text = " ".join(turn for q in reversed(questions) for turn in q)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        ids = ids + ids
    return "Background material for the conversation:\n" + tokenizer.decode(ids[:num_tokens])


def first_turns(tokenizer, questions: list[list[str]], num: int, system: str = "") -> list[Prompt]:
    """`num` prompts: MT-bench first turns and CODE_PROMPTS alternately, each list cycled."""
    pools = ([(q[0], MT_BENCH) for q in questions], [(c, CODE) for c in CODE_PROMPTS])
    picked = [pools[i % 2][i // 2 % len(pools[i % 2])] for i in range(num)]
    ids = {text: user_turn(tokenizer, text, system) for text, _ in picked}
    return [Prompt(ids[text], kind) for text, kind in picked]


def with_second_turns(questions: list[list[str]]) -> list[list[str]]:
    return [q for q in questions if len(q) > 1]


def second_turns(
    tokenizer, questions: list[list[str]], answers: list[list[int]], num: int, system: str = ""
) -> list[Prompt]:
    """`num` prompts (cycled): each question's second turn after its first turn and `answers`
    (the first turn's answer ids, one per question of `with_second_turns(questions)`)."""
    asked = with_second_turns(questions)
    if len(answers) != len(asked) or not asked:
        raise ValueError(f"{len(answers)} answers for {len(asked)} questions with a second turn")
    rendered = []
    for question, answer in zip(asked, answers, strict=True):
        chat = [
            {"role": "user", "content": question[0]},
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": question[1]},
        ]
        ids = render(tokenizer, chat, system)
        history = render(tokenizer, chat[:2], system, open_turn=False)
        history_len = len(history) if ids[: len(history)] == history else 0
        rendered.append(Prompt(ids, MT_BENCH, turn=2, history_len=history_len))
    return [rendered[i % len(rendered)] for i in range(num)]


def make_payloads(
    prompts: list[Prompt],
    temperature: float,
    max_new_tokens: int,
    ignore_eos: bool,
    seed: int = 0,
) -> list[Payload]:
    """Streamed native /generate requests that keep their output ids. A sampled request
    carries the seed `seed` + its index, so two runs of the same prompts (another server,
    another concurrency) draw the same noise and can be compared answer by answer."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0}
    sampling["ignore_eos"] = ignore_eos
    return [
        Payload(
            "/generate",
            {
                "input_ids": p.ids,
                "sampling_params": {**sampling, "seed": seed + i} if temperature > 0 else sampling,
                "stream": True,
            },
            len(p.ids),
            keep_output=True,
        )
        for i, p in enumerate(prompts)
    ]


def accept_length_by_kind(prompts: list[Prompt], results: list[RequestResult]) -> dict:
    """Per prompt kind: completion tokens over verify steps of its finished requests (each
    request's `spec_accept_length` is its own tokens over its verifies); None where no request
    of the kind reported one."""
    tokens: dict[str, float] = {}
    verifies: dict[str, float] = {}
    for prompt, result in zip(prompts, results, strict=True):
        tokens.setdefault(prompt.kind, 0.0)
        verifies.setdefault(prompt.kind, 0.0)
        if result.success and result.accept_length and result.output_len:
            tokens[prompt.kind] += result.output_len
            verifies[prompt.kind] += result.output_len / result.accept_length
    return {k: tokens[k] / verifies[k] if verifies[k] else None for k in tokens}
