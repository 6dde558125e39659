"""`triton`: paged attention in Triton kernels, the default backend on CUDA.

Decode (one query per request, no custom mask) runs the split-K kernel of
`kernels.decode_attention` (GQA grouped); every other mode (extend / prefill over a prefix in
the pool, tree verify and multi-step draft decode through the tree-local custom mask) runs
`kernels.extend_attention`. Both read KV positions through req_to_token on the device and
take every length from device tensors, so metadata needs no host read of seq_lens and the
same launches replay in CUDA graphs; the host values they use (`max_extend_len`) come with
the plan. On CPU the kernels run under TRITON_INTERPRET=1 (slow; how CI checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.base import AttentionBackend, AttentionLayer, register_backend
from gpu_worker.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    partial_buffers,
)
from gpu_worker.kernels.extend_attention import extend_attention
from gpu_worker.kv_cache import KVPool, ReqToTokenPool

MAX_SPLITS = 16
CPU_NUM_SMS = 4  # the interpreter has no SMs; a few splits still exercise the combine step


@dataclass(frozen=True)
class DecodeMetadata:
    num_splits: int
    partial_o: torch.Tensor  # [bs, H, num_splits, D] float32 scratch
    partial_lse: torch.Tensor  # [bs, H, num_splits] float32 scratch


@dataclass(frozen=True)
class ExtendMetadata:
    extend_start_loc: torch.Tensor  # [bs] int64, first token of each request
    max_extend_len: int  # host value from the plan (sizes the grid)


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool, num_heads)
        device = kv_pool.device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_NUM_SMS
        )
        self.num_kv_heads, self.head_dim = kv_pool.k_buffers[0].shape[1:]
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------------- metadata

    def init_forward_metadata(self, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        if self._is_decode(batch):
            bs = batch.batch_size
            num_splits = choose_num_splits(bs, self.num_kv_heads, self.num_sms, MAX_SPLITS)
            scratch = partial_buffers(
                bs, self.num_heads, num_splits, self.head_dim, self.kv_pool.device
            )
            return DecodeMetadata(num_splits, *scratch)
        return self._extend_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int) -> None:
        """Decode scratch for the largest batch, shared by every captured graph."""
        self._graph_scratch = partial_buffers(
            max_bs, self.num_heads, MAX_SPLITS, self.head_dim, self.kv_pool.device
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        if not self._is_decode(batch):
            return self._extend_metadata(batch)  # computed on the device, inside the graph
        assert self._graph_scratch is not None, "init_cuda_graph_state first"
        bs = batch.batch_size
        num_splits = choose_num_splits(bs, self.num_kv_heads, self.num_sms, MAX_SPLITS)
        partial_o, partial_lse = self._graph_scratch
        partial_o = partial_o.view(-1)[: bs * self.num_heads * num_splits * self.head_dim]
        partial_lse = partial_lse.view(-1)[: bs * self.num_heads * num_splits]
        return DecodeMetadata(num_splits, partial_o, partial_lse)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> DecodeMetadata | ExtendMetadata:
        """Nothing to refresh: the kernels read lengths and rows from the graph's static input
        tensors, which the graph runner has already filled."""
        return self.init_forward_metadata_capture(batch)

    @staticmethod
    def _is_decode(batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.custom_mask is None

    @staticmethod
    def _extend_metadata(batch: ForwardBatch) -> ExtendMetadata:
        lens = batch.extend_seq_lens.to(torch.int64)
        start_loc = torch.cumsum(lens, 0) - lens  # [bs]
        return ExtendMetadata(start_loc, max(batch.extend_seq_lens_cpu, default=0))

    # ------------------------------------------------------------------------- attention

    def forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        k_buffer, v_buffer = self.kv_pool.get_kv(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        meta = batch.attn_metadata
        if isinstance(meta, DecodeMetadata):
            return decode_attention(
                q, k_buffer, v_buffer, req_to_token, batch.req_pool_indices, batch.seq_lens,
                layer.scaling, meta.num_splits, meta.partial_o, meta.partial_lse,
            )  # fmt: skip
        return extend_attention(
            q, k_buffer, v_buffer, req_to_token, batch.req_pool_indices, batch.seq_lens,
            batch.extend_seq_lens, meta.extend_start_loc, meta.max_extend_len, layer.scaling,
            batch.custom_mask,
        )  # fmt: skip
