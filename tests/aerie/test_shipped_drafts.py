"""The default model's shipped drafts: `--speculative-algorithm X` alone serves the default
model with its draft for X; an explicit draft path wins; other models still need one."""

from __future__ import annotations

import json
import os

import pytest

import aerie.default_model as default_model
from aerie.config import config_from_args
from aerie.model_info import read_model_info
from aerie.resolve import ConfigError, resolve_config

MAX_FILE_BYTES = 25_000_000


@pytest.fixture
def default_dir(tmp_path, monkeypatch) -> str:
    """A stand-in for the converted default model (its real config, no weights needed)."""
    path = tmp_path / "SmolLM2-135M-Instruct"
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(default_model, "ensure_default_model", lambda cache_dir=None: str(path))
    monkeypatch.setattr(default_model, "default_model_dir", lambda cache_dir=None: str(path))
    return str(path)


def resolve(*argv: str):
    return resolve_config(config_from_args(["--device", "cpu", *argv])).speculative


@pytest.mark.parametrize(
    "algorithm, name, steps", [("EAGLE3", "eagle3", 3), ("EAGLE", "eagle", 3), ("MTP", "mtp", 3)]
)
def test_the_default_model_gets_its_shipped_draft(default_dir, algorithm, name, steps):
    spec = resolve("--speculative-algorithm", algorithm)
    assert spec.speculative_draft_model_path == os.path.join(default_model.SHIPPED_DRAFTS_DIR, name)
    assert spec.speculative_num_steps == steps and spec.speculative_num_draft_tokens == steps + 1
    # the same when the default model's directory is named explicitly
    explicit = resolve("--model-path", default_dir, "--speculative-algorithm", algorithm)
    assert explicit.speculative_draft_model_path == spec.speculative_draft_model_path


def test_an_explicit_draft_path_wins(default_dir):
    other = os.path.join(default_model.SHIPPED_DRAFTS_DIR, "eagle3")
    spec = resolve(
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        other,
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
    )
    assert spec.speculative_draft_model_path == other and spec.speculative_num_steps == 5
    with pytest.raises(ConfigError, match="LlamaForCausalLMEagle3"):
        resolve("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", other)


def test_other_models_still_need_a_draft(default_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(open(os.path.join(default_dir, "config.json")).read())
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="needs --speculative-draft-model-path"):
        resolve("--model-path", str(other), "--speculative-algorithm", "EAGLE3")


def test_a_missing_shipped_draft_says_how_to_get_one(default_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "SHIPPED_DRAFTS_DIR", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="python3 -m training"):
        resolve("--speculative-algorithm", "EAGLE3")


def test_the_shipped_drafts_are_what_their_algorithms_load():
    expected = {
        "eagle3": "LlamaForCausalLMEagle3",
        "eagle": "LlamaForCausalLMEagle",
        "mtp": "LlamaForCausalLM",
    }
    for name, architecture in expected.items():
        path = os.path.join(default_model.SHIPPED_DRAFTS_DIR, name)
        assert read_model_info(path).architecture == architecture
        for file in os.listdir(path):
            assert os.path.getsize(os.path.join(path, file)) < MAX_FILE_BYTES, file
    with open(os.path.join(default_model.SHIPPED_DRAFTS_DIR, "mtp", "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 3
