"""`ModelRunner`: one model with its own KV pool, req_to_token pool and attention backend.

The target, an EAGLE draft and each MTP layer are runners that share slot ids but never
storage, so a runner holds no global state. It is described by a `RunnerSpec` (what it loads,
how it runs) and a `PoolSpec` (its rows and slots); `gpu_worker.build` makes a server's runners.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from gpu_worker.attention import create_attention_backend
from gpu_worker.graphs.forward_graph import DecodeInputs, decode_graphs
from gpu_worker.graphs.forward_graph import graph_bytes as prefill_graph_bytes
from gpu_worker.graphs.stage_graph import StageGraph
from gpu_worker.kernels import batch_invariant, greedy_head
from gpu_worker.kv_cache import KVPool, ReqToTokenPool, kv_bytes_per_token
from gpu_worker.layers.layernorm import set_use_triton
from gpu_worker.layers.rotary import init_cos_sin_caches
from gpu_worker.models import ArchConfig, build_model, read_arch_config
from gpu_worker.models.mimo_mtp import mtp_arch_config
from gpu_worker.models.registry import is_draft_architecture
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.sampling import DrawNoise, coupled_reference
from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from gpu_worker.step.host_batch import HostBatch, Staging
from gpu_worker.weights import init_dummy_weights, list_tensor_names, load_weights

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30
# What the decode step's two sampling variants keep in their graphs per logit of the largest
# batch (float32 copies, sort values and int64 indices, the counter-based noise's int64
# hashes): measured on the H100, 1,396 MiB for 256 x 49,152 logits (116 bytes), with room.
SAMPLING_BYTES_PER_LOGIT = 128
DEFAULT_MEM_FRACTION_STATIC = 0.85


@dataclass(frozen=True)
class RunnerSpec:
    """What one runner loads and how it runs it.

    model_dir: a checkpoint directory (config.json, safetensors). load_format: auto /
    safetensors, or dummy (random weights from `seed`). mtp_layer: build MTP layer i of the
    checkpoint (the target's directory or a separate MTP directory, see
    `mimo_mtp.mtp_weights_dir`); a draft. aux_hidden_layers: target layers whose input stream
    `forward` also returns (EAGLE-3, see `eagle3_aux_layer_ids`). cuda_graph_max_bs: run DECODE
    batches of `forward_host` up to this size through `forward_graph.decode_graphs` (captured
    on CUDA when the attention backend supports it; the same padded path eagerly otherwise);
    0: always eager.
    graph_tokens: tokens per forward of the CUDA graphs others capture this runner's forwards
    in (the speculative stages: max batch x ND), kept out of the KV budget like its own graphs.
    prefill_graph_tokens: the largest prefill others replay as a graph of this runner's
    forward (`forward_graph.PrefillGraphs`), budgeted the same way. graph_sampled_rows: rows
    others sample from this runner's logits inside CUDA graphs (the plain decode step), whose
    sampling temporaries (probabilities, sorted copies, noise) the graphs keep too.
    tp: the tensor-parallel group the model is sharded over (a draft's must be its target's).
    """

    model_dir: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "torch_native"
    mtp_layer: int | None = None
    aux_hidden_layers: tuple[int, ...] = ()
    cuda_graph_max_bs: int = 0
    graph_tokens: int = 0
    prefill_graph_tokens: int = 0
    graph_sampled_rows: int = 0
    tp: TensorParallel = SINGLE


@dataclass(frozen=True)
class PoolSpec:
    """The request rows and KV slots a runner's pools hold.

    req_to_token rows are context_length + req_to_token_extra wide (speculative headroom past
    the context); context_length None: the model's max_position_embeddings. max_total_tokens:
    usable KV slots (rounded down to page_size); None sizes the pool from memory: the
    mem_fraction_static share of the device, less the weights, the graphs and
    shared_kv_bytes_per_token per slot for the pools that share this slot count (the drafts').
    A runner's `pools` is this spec resolved (both lengths concrete); a draft is given its
    target's `pools` unchanged, so one slot id addresses the same position in every pool.
    """

    max_running_requests: int = 64
    context_length: int | None = None
    req_to_token_extra: int = 0
    page_size: int = 1
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    shared_kv_bytes_per_token: int = 0


class ModelRunner:
    def __init__(
        self, spec: RunnerSpec, pools: PoolSpec, draft_of: ModelRunner | None = None
    ) -> None:
        """Load the model, then size and allocate the KV pool from what memory is left.

        draft_of: the target runner of this draft (EAGLE / EAGLE-3 / an MTP layer); `pools`
        must then be the target's `pools`.
        """
        if spec.mtp_layer is not None and draft_of is None:
            raise ValueError("an MTP layer is a draft: pass draft_of")
        if draft_of is not None and pools != draft_of.pools:
            raise ValueError("a draft shares its target's slots: pass draft_of.pools")
        if draft_of is not None and spec.tp != draft_of.spec.tp:
            raise ValueError("a draft runs in its target's tensor-parallel group")
        self.spec, self.tp = spec, spec.tp
        self.model_dir, self.mtp_layer = spec.model_dir, spec.mtp_layer
        self.device, self.dtype = torch.device(spec.device), spec.dtype
        self.config: ArchConfig = read_arch_config(self.model_dir)
        if self.mtp_layer is not None:
            self.config = mtp_arch_config(self.config, self.mtp_layer)
        # This rank's share of the heads (all of them without tensor parallelism).
        self.num_heads = self.tp.split(self.config.num_heads, "the number of attention heads")[1]
        self.num_kv_heads = self.tp.kv_heads(self.config.num_kv_heads)[1]
        self.page_size = pools.page_size
        self.max_running_requests = pools.max_running_requests
        self.context_length = pools.context_length or self.config.max_position_embeddings
        self.req_to_token_extra = pools.req_to_token_extra
        row_width = self.context_length + self.req_to_token_extra
        self.model = self._load_model(spec.load_format, spec.seed, draft_of)
        init_cos_sin_caches(self.model, row_width, self.device)
        set_use_triton(self.model, spec.attention_backend == "triton")
        # The fused LM head reads the whole vocabulary (one rank holds a block under TP).
        self.fused_greedy_head = (
            spec.attention_backend == "triton" and self.tp.size == 1 and not batch_invariant.ENABLED
        )
        self.aux_hidden_layers = self._check_aux_layers(list(spec.aux_hidden_layers))
        graph_tokens = max(spec.cuda_graph_max_bs, spec.graph_tokens)
        self.graph_reserve_bytes = (
            estimate_graph_bytes(self.config, graph_tokens, self.dtype)
            + prefill_graph_bytes(self.config, spec.prefill_graph_tokens, self.dtype)
            + spec.graph_sampled_rows * self.config.vocab_size * SAMPLING_BYTES_PER_LOGIT
            if self.device.type == "cuda"
            else 0
        )
        self.max_total_tokens = self._size_kv_pool(
            pools.max_total_tokens, pools.mem_fraction_static, pools.shared_kv_bytes_per_token
        )
        self.pools = dataclasses.replace(
            pools, context_length=self.context_length, max_total_tokens=self.max_total_tokens
        )
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, row_width, self.device)
        config = self.config
        self.kv_pool = KVPool(
            self.max_total_tokens,
            self.page_size,
            config.num_layers,
            self.num_kv_heads,
            config.head_dim,
            self.dtype,
            self.device,
        )
        self.staging = Staging(self.device)
        self.attn_backend = create_attention_backend(
            spec.attention_backend, self.req_to_token_pool, self.kv_pool, self.num_heads
        )
        self.decode_graphs: StageGraph | None = None
        if spec.cuda_graph_max_bs > 0:
            capture = self.device.type == "cuda" and self.attn_backend.supports_cuda_graph
            if self.device.type == "cuda" and not capture:
                log.warning(
                    "%s attention cannot be captured in CUDA graphs: decode runs eagerly",
                    spec.attention_backend,
                )
            self.decode_graphs = decode_graphs(self, spec.cuda_graph_max_bs, capture)
        log.info(
            "%s on %s (%s): KV pool of %d tokens",
            config.architecture,
            self.device,
            self.dtype,
            self.max_total_tokens,
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hot_token_id(self) -> torch.Tensor | None:
        """[draft_vocab] int64 target id of each draft-vocab id (EAGLE-3 with d2t), else None
        (logit columns are target ids)."""
        return getattr(self.model, "hot_token_id", None)

    def _load_model(
        self, load_format: str, seed: int, draft_of: ModelRunner | None
    ) -> torch.nn.Module:
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load format {load_format!r} (auto, safetensors, dummy)")
        is_draft = is_draft_architecture(self.config.architecture)
        if is_draft != (draft_of is not None):
            raise ValueError(
                f"{self.config.architecture} "
                + ("is a draft: pass draft_of" if is_draft else "is not a draft architecture")
            )
        options = {}
        if self.mtp_layer is not None:
            options["mtp_layer"] = self.mtp_layer
        elif is_draft:
            dummy = load_format == "dummy"
            options["tensor_names"] = None if dummy else list_tensor_names(self.model_dir)
        model = build_model(self.config, self.device, self.dtype, tp=self.tp, **options)
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            what = None if self.mtp_layer is None else f"MTP layer {self.mtp_layer}"
            load_weights(model, self.model_dir, what)
        if draft_of is not None:
            model.attach_target(draft_of.model)
        return model

    def _check_aux_layers(self, layers: list[int] | None) -> list[int] | None:
        if not layers:
            return None
        if not hasattr(self.model, "forward_with_aux"):
            raise ValueError(f"{self.config.architecture} cannot capture aux hidden states")
        if any(not 0 <= i <= self.config.num_layers for i in layers):
            raise ValueError(
                f"aux hidden layers {layers} out of range for {self.config.num_layers} layers"
            )
        return list(layers)

    def _size_kv_pool(
        self, max_total_tokens: int | None, mem_fraction: float | None, shared_per_token: int
    ) -> int:
        """Usable KV slots: as asked, or what the memory budget holds for this runner's pool
        and the pools sharing its slot count; a page_size multiple."""
        if max_total_tokens is None:
            per_token = shared_per_token + kv_bytes_per_token(
                self.config.num_layers, self.num_kv_heads, self.config.head_dim, self.dtype
            )
            max_total_tokens = self._kv_budget_bytes(mem_fraction) // per_token
            # More than every row at full context can never be used.
            max_total_tokens = min(
                max_total_tokens, self.max_running_requests * self.context_length
            )
            # Each tensor-parallel rank measures its own memory; all hold what the least fits.
            max_total_tokens = self.tp.agree_min(max_total_tokens)
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
        # Weights (and anything else resident) count against the same static fraction, and
        # so does what the CUDA graphs will take.
        return int(total * fraction) - (total - free) - self.graph_reserve_bytes

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Run the model on `batch` eagerly (writes the new tokens' KV into this runner's pool).
        A draft reads `batch.spec_info.hidden_states` [num_tokens, H_in]."""
        metadata = self.attn_backend.init_forward_metadata(batch)
        batch = dataclasses.replace(batch, attn_backend=self.attn_backend, attn_metadata=metadata)
        return self.run_model(batch)

    @torch.inference_mode()
    def forward_host(self, host: HostBatch, input_ids: torch.Tensor | None = None) -> LogitsOutput:
        """Run a batch given on the host: in a CUDA graph when one fits (the outputs are then
        views of its static buffers, valid until the next call), else eagerly after one copy
        through pinned staging. input_ids: token ids already on the device, instead of
        host.input_ids."""
        bs = host.batch_size
        graphs = self.decode_graphs
        if graphs is not None and host.mode == ForwardMode.DECODE and len(host.input_ids) == bs:
            arrays = DecodeInputs(
                host.input_ids if input_ids is None else input_ids,
                host.positions,
                host.out_cache_loc,
                host.rows,
                host.seq_lens,
            )
            return graphs.call_host(bs, arrays)
        batch = host.to_device(self.device, self.staging)
        if input_ids is not None:
            batch = dataclasses.replace(batch, input_ids=input_ids.long())
        return self.forward(batch)

    def run_model(self, batch: ForwardBatch) -> LogitsOutput:
        """The model and its logits for a batch whose attention metadata is set (the body that
        CUDA graphs capture)."""
        aux = None
        if self.aux_hidden_layers:
            hidden, aux = self.model.forward_with_aux(batch, self.aux_hidden_layers)
        else:
            hidden = self.model(batch)  # [num_tokens, hidden]
        every = batch.mode.samples_every_token() and batch.logits_indices is None
        sampled = hidden if every else hidden[batch.sample_indices()]
        if batch.greedy_ids:
            return LogitsOutput(None, hidden, aux, self.next_token_ids(sampled, batch.draw_noise))
        logits = self.model.compute_logits(sampled)  # [num_sampled, V]
        return LogitsOutput(next_token_logits=logits, hidden_states=hidden, aux_hidden_states=aux)

    def next_token_ids(self, hidden: torch.Tensor, noise: DrawNoise | None = None) -> torch.Tensor:
        """hidden [n, H] -> the argmax of its logits [n] int64 (with `noise`, each row's
        coupled proposal), in the target's vocabulary: the LM head and the argmax in two
        launches (`greedy_head`) for a few rows on one GPU."""
        if self.fused_greedy_head and greedy_head.fits(hidden.shape[0]):
            x = self.model.logits_input(hidden)
            return greedy_head.greedy_head(
                x, self.model.lm_head.weight, self.hot_token_id, self.attn_backend.num_sms, noise
            )
        logits = self.model.compute_logits(hidden)
        ids = logits.argmax(dim=-1) if noise is None else coupled_reference(logits, noise)
        return ids if self.hot_token_id is None else self.hot_token_id[ids]


def estimate_graph_bytes(config: ArchConfig, max_tokens: int, dtype: torch.dtype) -> int:
    """Device memory CUDA graphs of forwards of up to max_tokens tokens (all sampled) may take,
    kept out of the KV budget: static float32 logits and the largest activations, with room
    to spare."""
    if max_tokens <= 0:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    logits = max_tokens * config.vocab_size * 4 * 2  # static copy + the forward's own
    activations = max_tokens * (2 * config.intermediate_size + 8 * config.hidden_size) * element
    return logits + 4 * activations + (64 << 20)
