"""Reference outputs from Hugging Face transformers' own greedy `generate`."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # parity runs use ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = _load(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None,
    )
    return out[0, len(prompt_ids):].tolist()
