"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, explicit head_dim): Llama blocks with
different attention options."""

from __future__ import annotations

from gpu_worker.models.config import ArchConfig
from gpu_worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: ArchConfig) -> dict[str, bool]:
        if config.raw.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: ArchConfig) -> dict[str, bool]:
        bias = config.attention_bias
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
