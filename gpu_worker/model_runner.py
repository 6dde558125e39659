"""`ModelRunner`: one model with its own KV pool, req_to_token pool and attention backend.

Speculative decoding builds several runners (target, draft, one per MTP layer) that share slot
ids but never storage, so a runner holds no global state. The scheduler decides which rows and
slots a request uses; the caller writes them into `req_to_token_pool` and builds the
`ForwardBatch`; `forward` runs the model and returns logits for the sampled positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from aerie.model_info import ModelInfo
from gpu_worker.attention import create_attention_backend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kv_cache import KVPool, ReqToTokenPool, kv_bytes_per_token
from gpu_worker.models import ArchConfig, build_model, read_arch_config
from gpu_worker.weights import init_dummy_weights, load_weights

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30
DEFAULT_MEM_FRACTION_STATIC = 0.85


@dataclass
class LogitsOutput:
    """next_token_logits: [num_sampled, vocab] float32, one row per sampled position (each
    request's last token for extend modes, every token for DECODE/TARGET_VERIFY).
    hidden_states: [num_tokens, hidden] after the final norm, for every token run."""

    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: str | ModelInfo,
        device: torch.device | str,
        dtype: torch.dtype,
        load_format: str = "auto",
        seed: int = 0,
        page_size: int = 1,
        max_total_tokens: int | None = None,
        max_running_requests: int = 64,
        context_length: int | None = None,
        attention_backend: str = "torch_native",
        mem_fraction_static: float | None = None,
    ) -> None:
        """Load the model, then size and allocate the KV pool from what memory is left.

        max_total_tokens: usable KV slots (rounded down to page_size); None sizes it from
        memory. context_length: width of a req_to_token row; None uses the model's
        max_position_embeddings.
        """
        self.model_dir = model.path if isinstance(model, ModelInfo) else model
        self.device = torch.device(device)
        self.dtype = dtype
        self.page_size = page_size
        self.config: ArchConfig = read_arch_config(self.model_dir)
        self.context_length = context_length or self.config.max_position_embeddings
        self.max_running_requests = max_running_requests
        self.model = self._load_model(load_format, seed)
        self.max_total_tokens = self._size_kv_pool(max_total_tokens, mem_fraction_static)
        self.req_to_token_pool = ReqToTokenPool(
            max_running_requests, self.context_length, self.device
        )
        self.kv_pool = KVPool(
            self.max_total_tokens,
            page_size,
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            dtype,
            self.device,
        )
        self.attn_backend = create_attention_backend(
            attention_backend, self.req_to_token_pool, self.kv_pool
        )
        log.info(
            "%s on %s (%s): KV pool of %d tokens",
            self.config.architecture,
            self.device,
            dtype,
            self.max_total_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _load_model(self, load_format: str, seed: int) -> torch.nn.Module:
        model = build_model(self.config, self.device, self.dtype)
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        elif load_format in ("auto", "safetensors"):
            load_weights(model, self.model_dir)
        else:
            raise ValueError(f"unknown load format {load_format!r} (auto, safetensors, dummy)")
        return model

    def _size_kv_pool(self, max_total_tokens: int | None, mem_fraction: float | None) -> int:
        """Usable KV slots: as asked, or what the memory budget holds; a page_size multiple."""
        if max_total_tokens is None:
            per_token = kv_bytes_per_token(
                self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, self.dtype
            )
            max_total_tokens = self._kv_budget_bytes(mem_fraction) // per_token
            if self.device.type != "cuda":
                max_total_tokens = min(
                    max_total_tokens, self.max_running_requests * self.context_length
                )
        max_total_tokens = max_total_tokens // self.page_size * self.page_size
        if max_total_tokens <= 0:
            raise RuntimeError(
                "no memory left for the KV cache; lower the context length, "
                "raise --mem-fraction-static or pass --max-total-tokens"
            )
        return max_total_tokens

    def _kv_budget_bytes(self, mem_fraction: float | None) -> int:
        if self.device.type != "cuda":
            return CPU_KV_BUDGET_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = DEFAULT_MEM_FRACTION_STATIC if mem_fraction is None else mem_fraction
        # Weights (and anything else resident) count against the same static fraction.
        return int(total * fraction) - (total - free)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Run the model on `batch` (writes the new tokens' KV into this runner's pool)."""
        batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[batch.sample_indices()])  # [num_sampled, V]
        return LogitsOutput(next_token_logits=logits, hidden_states=hidden)
