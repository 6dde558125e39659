"""Fixtures of the training tests: a tiny target that is easy to learn, its own greedy data,
and drafts of every kind trained briefly on it (all made once per session, on the CPU).

The target is the bigram model of the speculative tests (its next token depends only on the
current one), so a few dozen optimiser steps give drafts that agree with it at some positions
and not at others: the accept lengths they give vary, which is what the alignment tests need.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from aerie.config import AerieConfig
from tests.gpu_worker.draft_checkpoints import make_bigram_target
from training.generate import GenerateConfig, generate
from training.tokens import TokenFile
from training.train import TrainConfig, Trainer

VOCAB = 320
NUM_PROMPTS = 48
NUM_DEV = 8
MAX_NEW = 40
ALGORITHMS = ("eagle3", "eagle", "mtp")
DEPTH = {"eagle3": 3, "eagle": 2, "mtp": 3}  # unrolled steps (MTP: layers)
SERVED = {"eagle3": "EAGLE3", "eagle": "EAGLE", "mtp": "MTP"}  # --speculative-algorithm


def random_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(n)]


def write_prompts(path: str, prompts: list[list[int]], num_dev: int) -> str:
    dev = np.arange(len(prompts)) < num_dev
    TokenFile.from_sequences(prompts, [len(p) for p in prompts], dev=dev).save(path)
    return path


def train_config(algorithm: str, target: str, data: str, out: str, **overrides) -> TrainConfig:
    """A short CPU run: small batches, a high learning rate, no time limit."""
    options = dict(
        depth=DEPTH[algorithm],
        epochs=6.0,
        lr=3e-3,
        warmup=0.05,
        tokens_per_batch=640,
        draft_vocab=200,
        log_every=1000,
        eval_every=1000,
        device="cpu",
    )
    return TrainConfig(algorithm, target, data, out, **{**options, **overrides})


def engine_config(
    target: str, algorithm: str | None = None, draft: str | None = None, depth: int = 0
) -> AerieConfig:
    """A CPU engine serving `target` (with a chain of `depth` from `draft`): the reference
    backend, direct (ungraphed) stages so spies see every call."""
    spec = {}
    if algorithm is not None:
        spec = {
            "speculative_algorithm": SERVED[algorithm],
            "speculative_draft_model_path": draft,
            "speculative_num_steps": depth,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": depth + 1,
        }
    return AerieConfig().replace(
        model={
            "model_path": target,
            "tokenizer_path": target,
            "device": "cpu",
            "dtype": "float32",
            "load_format": "safetensors",
            "context_length": 256,
        },
        cache={"max_total_tokens": 4096},
        scheduler={"max_running_requests": 4},
        speculative=spec,
        runner={"attention_backend": "torch_native", "cuda_graph_max_bs": 0},
    )


@pytest.fixture(scope="session")
def bigram_target(tmp_path_factory) -> str:
    return make_bigram_target(
        str(tmp_path_factory.mktemp("bigram")), vocab_size=VOCAB, max_position_embeddings=512
    )


@pytest.fixture(scope="session")
def greedy_data(bigram_target, tmp_path_factory) -> str:
    """The target's greedy responses to random prompts (the first NUM_DEV held out)."""
    root = tmp_path_factory.mktemp("data")
    prompts = write_prompts(str(root / "prompts.npz"), random_prompts(0, NUM_PROMPTS), NUM_DEV)
    out = str(root / "data.npz")
    generate(
        GenerateConfig(
            bigram_target,
            prompts,
            out,
            batch_size=16,
            max_new_tokens=MAX_NEW,
            sampled_per_prompt=0,
            device="cpu",
        )
    )
    return out


@pytest.fixture(scope="session")
def trained(bigram_target, greedy_data, tmp_path_factory) -> dict[str, dict]:
    """algorithm -> {"draft": exported draft dir, "result": what the run returned}."""
    out = {}
    for algorithm in ALGORITHMS:
        root = str(tmp_path_factory.mktemp(f"train-{algorithm}"))
        result = Trainer(train_config(algorithm, bigram_target, greedy_data, root)).run()
        out[algorithm] = {"draft": f"{root}/draft", "result": result, "out": root}
    return out
