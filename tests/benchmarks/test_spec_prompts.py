"""The served speculation benchmark's prompts: first turns alternating MT-bench and code, second
turns after a given answer, all in the chat template; and the per-kind accept length."""

from __future__ import annotations

import json

import pytest

from benchmarks import spec_prompts
from benchmarks.serving_load import RequestResult
from benchmarks.spec_prompts import (
    CODE,
    CODE_PROMPTS,
    MT_BENCH,
    Prompt,
    accept_length_by_kind,
    first_turns,
    load_questions,
    load_tokenizer,
    make_payloads,
    second_turns,
    system_prompt,
)
from tests.tokenizer_fixture import make_tiny_tokenizer

TEMPLATE = "<|im_start|>{role}\n{content}<|im_end|>\n"
OPEN = "<|im_start|>assistant\n"


@pytest.fixture
def tokenizer(tmp_path):
    return load_tokenizer(make_tiny_tokenizer(tmp_path / "tok"))


def test_first_turns_alternate_mt_bench_and_code_in_the_chat_template(tokenizer):
    prompts = first_turns(tokenizer, [["Hello?", "More?"], ["Why?"]], 6)
    expected = ["Hello?", CODE_PROMPTS[0], "Why?", CODE_PROMPTS[1], "Hello?", CODE_PROMPTS[2]]
    for prompt, content in zip(prompts, expected, strict=True):
        assert tokenizer.decode(prompt.ids) == TEMPLATE.format(role="user", content=content) + OPEN
        assert prompt.turn == 1
    assert [p.kind for p in prompts] == [MT_BENCH, CODE] * 3


def test_second_turns_follow_the_first_and_its_answer(tokenizer):
    questions = [["Hello?", "And then?"], ["Only one turn"], ["Why?", "Really?"]]
    answers = [tokenizer.encode("Hi there", add_special_tokens=False), tokenizer.encode("Because")]
    prompts = second_turns(tokenizer, questions, answers, 3)  # cycled
    chats = [("Hello?", "Hi there", "And then?"), ("Why?", "Because", "Really?")]
    for prompt, (first, answer, second) in zip(prompts, [*chats, chats[0]], strict=True):
        expected = (
            TEMPLATE.format(role="user", content=first)
            + TEMPLATE.format(role="assistant", content=answer)
            + TEMPLATE.format(role="user", content=second)
            + OPEN
        )
        assert tokenizer.decode(prompt.ids) == expected
        assert (prompt.kind, prompt.turn) == (MT_BENCH, 2)
        # The history a chat server ran for the first turn: up to the answer's end.
        history = tokenizer.decode(prompt.ids[: prompt.history_len])
        assert history == expected[: expected.index(second) - len("<|im_start|>user\n")]
    with pytest.raises(ValueError, match="1 answers for 2 questions"):
        second_turns(tokenizer, questions, answers[:1], 3)


def test_a_shared_system_prompt_opens_every_chat(tokenizer):
    questions = [["Hello there, how are you?", "And then?"], ["Why?", "Really?"]]
    system = system_prompt(tokenizer, questions, 40)
    assert len(tokenizer.encode(system, add_special_tokens=False)) >= 40
    assert system_prompt(tokenizer, questions, 0) == ""
    opening = TEMPLATE.format(role="system", content=system)
    for prompt in first_turns(tokenizer, questions, 4, system):
        assert tokenizer.decode(prompt.ids).startswith(opening)
    answers = [tokenizer.encode("Fine", add_special_tokens=False)] * 2
    for prompt in second_turns(tokenizer, questions, answers, 2, system):
        assert tokenizer.decode(prompt.ids[: prompt.history_len]).startswith(opening)


def test_payloads_stream_the_ids_and_keep_the_output():
    payloads = make_payloads([Prompt([5, 6, 7], CODE)], 0.7, 32, ignore_eos=True)
    (payload,) = payloads
    assert payload.path == "/generate" and payload.keep_output and payload.prompt_len == 3
    assert payload.body["input_ids"] == [5, 6, 7] and payload.body["stream"]
    params = payload.body["sampling_params"]
    assert params["temperature"] == 0.7 and params["max_new_tokens"] == 32 and params["ignore_eos"]


def test_sampled_payloads_carry_a_seed_per_prompt_and_greedy_ones_none():
    prompts = [Prompt([5], CODE), Prompt([6], CODE)]
    sampled = [p.body["sampling_params"]["seed"] for p in make_payloads(prompts, 0.7, 8, False, 9)]
    assert sampled == [9, 10]  # the same in every run of these prompts
    assert all("seed" not in p.body["sampling_params"] for p in make_payloads(prompts, 0, 8, False))


def test_accept_length_by_kind_weighs_requests_by_their_tokens():
    prompts = [Prompt([1], MT_BENCH), Prompt([1], MT_BENCH), Prompt([1], CODE), Prompt([1], CODE)]
    results = [
        RequestResult(1, output_len=30, success=True, accept_length=3.0),  # 10 verifies
        RequestResult(1, output_len=10, success=True, accept_length=1.0),  # 10 verifies
        RequestResult(1, output_len=8, success=False, accept_length=2.0),  # failed: left out
        RequestResult(1, output_len=5, success=True, accept_length=None),  # plain server
    ]
    assert accept_length_by_kind(prompts, results) == {MT_BENCH: 2.0, CODE: None}


def test_questions_load_with_their_turns_and_a_missing_file_says_where_to_get_one(
    monkeypatch, tmp_path
):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"turns": ["a", "b"]}) + "\n\n" + json.dumps({"turns": ["c"]}))
    assert load_questions(str(path)) == [["a", "b"], ["c"]]
    monkeypatch.setattr(spec_prompts, "DEFAULT_PROMPTS", str(tmp_path / "absent.jsonl"))
    with pytest.raises(SystemExit, match="FastChat's question.jsonl"):
        load_questions(None)


def test_the_plot_draws_first_turns_only():
    from benchmarks.plot_spec_serving import lines

    rows = [
        {"server": "plain", "temperature": 0.0, "concurrency": 1},
        {"server": "eagle3", "temperature": 0.0, "concurrency": 16, "turn": 1},
        {"server": "eagle3", "temperature": 0.0, "concurrency": 1},  # a report without turns
        {"server": "eagle3", "temperature": 0.0, "concurrency": 1, "turn": 2},
    ]
    drawn = lines({"rows": rows})
    assert list(drawn) == [("eagle3", 0.0)]
    assert [r["concurrency"] for r in drawn["eagle3", 0.0]] == [1, 16]
    assert all(r.get("turn", 1) == 1 for r in drawn["eagle3", 0.0])
