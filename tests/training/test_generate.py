"""Training data from the target itself: greedy responses are the target's own greedy output,
cut after the first stop token or at max_new_tokens, rows are refilled as they finish, and
sampled responses follow the seed."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.training.conftest import random_prompts, write_prompts
from training.generate import GenerateConfig, generate

MAX_NEW = 24


@torch.no_grad()
def hf_greedy(model_dir: str, prompt: list[int], max_new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def set_stop_token(model_dir: str, token: int) -> None:
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        with open(path) as f:
            config = json.load(f)
        config["eos_token_id"] = token
        with open(path, "w") as f:
            json.dump(config, f)


def test_greedy_responses_are_the_targets_own_and_stop_after_the_stop_token(tmp_path):
    target = make_tiny_checkpoint(
        str(tmp_path / "target"), "llama", vocab_size=320, max_position_embeddings=512
    )
    prompts = random_prompts(seed=3, n=10)
    references = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    stop = references[0][5]  # a token the first response reaches at its 6th step
    set_stop_token(target, stop)
    path = write_prompts(str(tmp_path / "prompts.npz"), prompts, num_dev=2)
    # 3 rows for 10 prompts: rows are refilled as responses finish
    data = generate(
        GenerateConfig(
            target,
            path,
            str(tmp_path / "data.npz"),
            batch_size=3,
            max_new_tokens=MAX_NEW,
            sampled_per_prompt=0,
            check_every=4,
            device="cpu",
        )
    )
    assert len(data) == len(prompts)
    assert data.extra["prompt"].tolist() == list(range(10))
    assert data.extra["dev"].tolist() == [True, True] + [False] * 8
    for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        sequence = data.sequence(i).tolist()
        assert sequence[: len(prompt)] == prompt and data.prompt_lens[i] == len(prompt)
        response = sequence[len(prompt) :]
        if stop in reference:
            cut = reference.index(stop) + 1
            assert response == reference[:cut] and data.extra["finished"][i]
        else:
            assert response == reference and not data.extra["finished"][i]
    assert data.extra["finished"][0] and len(data.sequence(0)) == len(prompts[0]) + 6


def test_sampled_responses_follow_the_seed(tmp_path):
    target = make_tiny_checkpoint(
        str(tmp_path / "target"), "llama", vocab_size=320, max_position_embeddings=512
    )
    set_stop_token(target, 10_000)  # never: every response runs to MAX_NEW
    path = write_prompts(str(tmp_path / "prompts.npz"), random_prompts(seed=4, n=6), num_dev=2)

    def run(seed: int, name: str):
        return generate(
            GenerateConfig(
                target,
                path,
                str(tmp_path / name),
                batch_size=4,
                max_new_tokens=MAX_NEW,
                sampled_per_prompt=1,
                temperature=1.0,
                seed=seed,
                device="cpu",
            )
        )

    a, b, c = run(0, "a.npz"), run(0, "b.npz"), run(1, "c.npz")
    # every prompt greedily, then each non-dev prompt once sampled
    assert a.extra["greedy"].tolist() == [True] * 6 + [False] * 4
    assert a.extra["prompt"].tolist() == list(range(6)) + [2, 3, 4, 5]
    assert np.array_equal(a.tokens, b.tokens)
    sampled = slice(int(a.offsets[6]), None)
    assert not np.array_equal(a.tokens[sampled], c.tokens[sampled])
    greedy = slice(0, int(a.offsets[6]))
    assert np.array_equal(a.tokens[greedy], c.tokens[greedy])
    for i in range(6, 10):  # sampled responses differ from the same prompt's greedy one
        assert a.sequence(i).tolist() != a.sequence(int(a.extra["prompt"][i])).tolist()
