"""`triton`: paged attention in Triton kernels, the default backend on CUDA.

Decode runs RoPE, the K/V store and attention in one kernel (`decode_attention`); batches of
the same few queries per request take `few_query_attention`, anything else the RoPE+store
kernel and `extend_attention`; in the deterministic mode (`batch_invariant`) every forward
takes its batch-invariant launch. Every length comes from device tensors, so the same launches
replay in CUDA graphs; host values (`max_extend_len`, the query count) come with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.base import (
    AttentionBackend,
    AttentionLayer,
    RopeArgs,
    register_backend,
)
from gpu_worker.kernels import batch_invariant, pdl
from gpu_worker.kernels.decode_attention import (
    DecodeScratch,
    choose_num_splits,
    decode_attention,
)
from gpu_worker.kernels.extend_attention import (
    extend_attention,
    extend_num_splits,
)
from gpu_worker.kernels.few_query_attention import (
    NewTokens,
    few_query_attend,
    few_query_attention,
    fits,
    scratch_for,
)
from gpu_worker.kernels.rotary import rope_and_store_kv
from gpu_worker.kv_cache import KVPool, ReqToTokenPool
from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode

CPU_NUM_SMS = 8  # no SMs in the interpreter: splits to exercise the combine, few to run idle


@dataclass(frozen=True)
class DecodeMetadata:
    num_splits: int


@dataclass(frozen=True)
class FewQueryMetadata:
    num_queries: int  # per request, the same for every request
    num_splits: int


@dataclass(frozen=True)
class ExtendMetadata:
    extend_start_loc: torch.Tensor  # [bs] int64, first token of each request
    max_extend_len: int  # host value from the plan (sizes the grid)
    num_splits: int = 1  # of each request's keys (`extend_num_splits`)
    invariant: bool = False  # the deterministic mode's launch (`extend_attention`)


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    reads_host_lengths = False  # only the extend lengths, which every plan knows
    rope_and_store = staticmethod(rope_and_store_kv)

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int) -> None:
        super().__init__(req_to_token_pool, kv_pool, num_heads)
        device = kv_pool.device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_NUM_SMS
        )
        self.num_kv_heads, self.head_dim = kv_pool.k_buffers[0].shape[1:]
        # Split-K partials and counters per number of queries per request (decode: 1), for
        # every request row at least; allocated on first use, before any capture (graphs run
        # each batch size eagerly first). One outgrown by a larger batch is kept alive:
        # captured launches may still point into it.
        self.scratch: dict[int, DecodeScratch] = {}
        self.retired_scratch: list[DecodeScratch] = []
        self._scratch(1, req_to_token_pool.num_rows)

    def _scratch(self, queries: int, bs: int) -> DecodeScratch:
        scratch = self.scratch.get(queries)
        if scratch is None or scratch.max_bs < bs:
            if scratch is not None:
                self.retired_scratch.append(scratch)
            scratch = self.scratch[queries] = scratch_for(
                max(bs, self.req_to_token_pool.num_rows),
                queries,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.num_sms,
                self.kv_pool.device,
            )
        return scratch

    # ------------------------------------------------------------------------- metadata

    def init_forward_metadata(
        self, batch: ForwardBatch
    ) -> DecodeMetadata | FewQueryMetadata | ExtendMetadata:
        if batch_invariant.ENABLED:
            return self._invariant_metadata(batch)
        if batch.mode == ForwardMode.DECODE and batch.custom_mask is None:
            bs = batch.batch_size
            self._scratch(1, bs)
            return DecodeMetadata(choose_num_splits(bs, self.num_kv_heads, self.num_sms))
        lens_cpu = batch.extend_seq_lens_cpu
        if batch.mode != ForwardMode.EXTEND and lens_cpu and len(set(lens_cpu)) == 1:
            queries, bs = lens_cpu[0], len(lens_cpu)
            # The split count and PDL are constexprs of the kernel. A captured launch compiles
            # at capture; the warm-up compiled eager ones (a draft pass over equal prompt
            # chunks) as one request launches them, so an eager batch that splits otherwise,
            # or takes PDL otherwise (PDL covers launches of up to pdl.MAX_ROWS rows), runs the
            # extend kernel rather than compile a variant while serving.
            if fits(queries, self.num_heads, self.num_kv_heads):
                splits = choose_num_splits(bs, self.num_kv_heads, self.num_sms)
                device = self.kv_pool.device
                as_one = splits == choose_num_splits(
                    1, self.num_kv_heads, self.num_sms
                ) and pdl.launch_args(device, bs * queries) == pdl.launch_args(device, queries)
                if as_one or self._capturing():
                    self._scratch(queries, bs)
                    return FewQueryMetadata(queries, splits)
        lens = batch.extend_seq_lens.to(torch.int64)
        start_loc = torch.cumsum(lens, 0) - lens  # [bs], on the device
        max_len = max(batch.extend_seq_lens_cpu, default=0)
        splits = extend_num_splits(batch.num_tokens, max_len, self.num_heads, self.num_sms)
        return ExtendMetadata(start_loc, max_len, splits)

    def _invariant_metadata(self, batch: ForwardBatch) -> ExtendMetadata:
        """Every forward as one batch-invariant extend launch: decode, verify and prefill
        alike."""
        lens = batch.extend_seq_lens.to(torch.int64)
        max_len = max(batch.extend_seq_lens_cpu, default=0)
        return ExtendMetadata(torch.cumsum(lens, 0) - lens, max_len, invariant=True)

    def _capturing(self) -> bool:
        device = self.kv_pool.device
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------------- attention

    def attend(
        self, qkv: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, rope: RopeArgs
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        k_buffer, v_buffer = self.kv_pool.get_kv(layer.layer_id)
        mask = batch.custom_mask
        if isinstance(meta, FewQueryMetadata) and (
            mask is None or mask.shape[-1] == meta.num_queries
        ):  # the new tokens are the last keys: RoPE and the K/V store in the same kernel
            new = NewTokens(
                batch.positions,
                batch.out_cache_loc,
                rope.cos_sin_cache,
                rope.q_norm,
                rope.k_norm,
                rope.eps,
            )
            return few_query_attend(
                qkv,
                layer.num_heads,
                new,
                k_buffer,
                v_buffer,
                self.req_to_token_pool.req_to_token,
                batch.rows,
                batch.seq_lens,
                meta.num_queries,
                layer.scaling,
                meta.num_splits,
                self.scratch[meta.num_queries],
                mask,
            )
        if not isinstance(meta, DecodeMetadata):
            return super().attend(qkv, layer, batch, rope)
        return decode_attention(
            qkv,
            batch.positions,
            rope.cos_sin_cache,
            k_buffer,
            v_buffer,
            batch.out_cache_loc,
            self.req_to_token_pool.req_to_token,
            batch.rows,
            batch.seq_lens,
            layer.num_heads,
            layer.scaling,
            meta.num_splits,
            self.scratch[1],
            rope.q_norm,
            rope.k_norm,
            rope.eps,
        )

    def forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        k_buffer, v_buffer = self.kv_pool.get_kv(layer.layer_id)
        meta = batch.attn_metadata
        if isinstance(meta, FewQueryMetadata):
            return few_query_attention(
                q,
                k_buffer,
                v_buffer,
                self.req_to_token_pool.req_to_token,
                batch.rows,
                batch.seq_lens,
                meta.num_queries,
                layer.scaling,
                meta.num_splits,
                self.scratch[meta.num_queries],
                batch.custom_mask,
            )
        return extend_attention(
            q,
            k_buffer,
            v_buffer,
            self.req_to_token_pool.req_to_token,
            batch.rows,
            batch.seq_lens,
            batch.extend_seq_lens,
            meta.extend_start_loc,
            meta.max_extend_len,
            layer.scaling,
            batch.custom_mask,
            meta.num_splits,
            meta.invariant,
        )
