"""Build what a GPU worker runs from a resolved configuration: the one place that knows how.

`build_models(config)` makes the target runner, the draft runners, the per-row `SamplingState`
and the speculative worker, and plans the memory with drafts (`docs/architecture.md`, "How the
GPU worker is built").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from aerie.config import AerieConfig
from gpu_worker.attention.base import backend_class
from gpu_worker.kernels import batch_invariant
from gpu_worker.kv_cache import kv_bytes_per_token
from gpu_worker.model_runner import DEFAULT_MEM_FRACTION_STATIC, ModelRunner, PoolSpec, RunnerSpec
from gpu_worker.models import read_arch_config
from gpu_worker.models.llama_eagle3 import eagle3_aux_layer_ids
from gpu_worker.models.mimo_mtp import mtp_kv_bytes_per_token, mtp_weights_dir
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.sampling import SamplingState
from gpu_worker.speculative.eagle_worker import EagleWorker
from gpu_worker.speculative.iteration import ACCEPT_GRAPH_ROWS, SpeculativeWorker
from gpu_worker.speculative.mtp_worker import MTPWorker
from gpu_worker.step.row_state import RowState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# With a draft, the target leaves this share of its memory budget to the draft's weights and
# activations (the draft's KV pool is budgeted exactly, through shared_kv_bytes_per_token).
DRAFT_MEMORY_SHARE = 0.05


@dataclass
class Models:
    """target: the served model; draft_runner_list: its drafts (empty without speculation);
    sampling: per-row sampling state; rows: each request row's last token and committed
    length; speculative: the worker that runs a speculative decode iteration over them (None
    without speculation)."""

    target: ModelRunner
    draft_runner_list: list[ModelRunner]
    sampling: SamplingState
    rows: RowState
    speculative: SpeculativeWorker | None


def build_models(config: AerieConfig, tp: TensorParallel = SINGLE) -> Models:
    """tp: this process's rank in the tensor-parallel group (every runner is sharded over it)."""
    if "auto" in (config.model.device, config.model.dtype, config.runner.attention_backend):
        raise ValueError("the config is not resolved: use aerie.resolve.resolve_config first")
    if not config.model.model_path:
        raise ValueError("config.model.model_path is not resolved")
    # process-wide, before any runner chooses its kernels
    batch_invariant.enable(config.runner.enable_deterministic_inference)
    target = ModelRunner(target_spec(config, tp), target_pools(config))
    sampling = SamplingState(target.max_running_requests, target.vocab_size, target.device)
    rows = RowState(target.max_running_requests + 1, target.device)
    spec = config.speculative
    if not spec.enabled:
        return Models(target, [], sampling, rows, None)
    drafts = [ModelRunner(s, target.pools, draft_of=target) for s in draft_specs(config, tp)]
    worker: SpeculativeWorker
    if spec.speculative_algorithm == "MTP":
        worker = MTPWorker(spec, target, drafts, sampling, rows, graph_max_bs(config))
    else:
        worker = EagleWorker(spec, target, drafts[0], sampling, rows, graph_max_bs(config))
    return Models(target, drafts, sampling, rows, worker)


def graph_max_bs(config: AerieConfig) -> int:
    """The largest decode batch run through CUDA graphs (0: none)."""
    if config.runner.disable_cuda_graph:
        return 0
    return config.runner.cuda_graph_max_bs or 0


def eager_rows_warning(config: AerieConfig, device_type: str) -> str | None:
    """What to warn of when decode batches can outgrow the captured graphs, else None."""
    graphed, rows = graph_max_bs(config), config.scheduler.max_running_requests or 0
    if device_type != "cuda" or not 0 < graphed < rows:
        return None
    return (
        f"decode batches above {graphed} (--cuda-graph-max-bs) run eagerly, several times "
        f"slower a step than graphed ones; up to {rows} can run (--max-running-requests)"
    )


def prefill_graph_tokens(config: AerieConfig) -> int:
    """The largest prefill replayed as a CUDA graph (0: none)."""
    if config.runner.disable_cuda_graph:
        return 0
    return config.runner.cuda_graph_max_prefill_tokens or 0


def target_spec(config: AerieConfig, tp: TensorParallel = SINGLE) -> RunnerSpec:
    model, spec = config.model, config.speculative
    # Graph memory is kept out of the KV budget only where graphs will be captured.
    captured = backend_class(config.runner.attention_backend).supports_cuda_graph
    graph_bs = graph_max_bs(config) if captured else 0
    graph_tokens = graph_bs * (spec.speculative_num_draft_tokens or 1)  # verify rows
    return RunnerSpec(
        model.model_path or "",
        device=model.device,
        dtype=DTYPES[model.dtype],
        load_format=model.load_format,
        seed=model.random_seed,
        attention_backend=config.runner.attention_backend,
        aux_hidden_layers=tuple(eagle3_aux_layers(config)),
        # The worker captures the target's forwards in its own stage graphs (the plain decode
        # step, or the speculative stages), budgeted through graph_tokens.
        cuda_graph_max_bs=0,
        graph_tokens=graph_tokens,
        prefill_graph_tokens=prefill_graph_tokens(config) if captured else 0,
        # The plain decode step samples inside its graphs, one row per request; speculation in
        # its accept graphs, one row per tree node, up to ACCEPT_GRAPH_ROWS of them, and with
        # adaptive speculation in the plain decode step's graphs too (one memory pool, but
        # the graphs keep their own temporaries).
        graph_sampled_rows=(
            min(graph_tokens, ACCEPT_GRAPH_ROWS) + graph_bs * spec.adaptive
            if spec.enabled
            else graph_bs
        ),
        tp=tp,
    )


def target_pools(config: AerieConfig) -> PoolSpec:
    """The target's rows and slots; with speculation its memory-sized pool leaves room for the
    draft pools (same slot count) and the drafts' weights."""
    spec = config.speculative
    mem_fraction = config.cache.mem_fraction_static
    if spec.enabled:
        mem_fraction = (mem_fraction or DEFAULT_MEM_FRACTION_STATIC) * (1 - DRAFT_MEMORY_SHARE)
    return PoolSpec(
        max_running_requests=config.scheduler.max_running_requests or 64,
        context_length=config.model.context_length,
        # Headroom past the context: the step's own, and the one of a decode step still in
        # flight under the overlap schedule (its accepted tokens are not known when the next
        # step is planned).
        req_to_token_extra=2 * spec.decode_alloc_len,
        page_size=config.cache.page_size,
        max_total_tokens=config.cache.max_total_tokens,
        mem_fraction_static=mem_fraction,
        shared_kv_bytes_per_token=draft_kv_bytes_per_token(config, DTYPES[config.model.dtype]),
    )


def draft_specs(config: AerieConfig, tp: TensorParallel = SINGLE) -> list[RunnerSpec]:
    """One EAGLE / EAGLE-3 draft, or one runner per MTP layer (each its own seed, so random
    layers differ), in the target's tensor-parallel group. --load-format dummy (benchmarks)
    gives the drafts random weights too."""
    model, spec = config.model, config.speculative
    common = RunnerSpec(
        spec.speculative_draft_model_path or "",
        device=model.device,
        dtype=DTYPES[model.dtype],
        load_format="dummy" if model.load_format == "dummy" else "auto",
        seed=model.random_seed,
        attention_backend=config.runner.attention_backend,
        tp=tp,
    )
    if spec.speculative_algorithm != "MTP":
        return [common]
    target_dir, draft_dir = model.model_path or "", spec.speculative_draft_model_path
    if model.load_format == "dummy":  # random weights: only a config is needed
        where = draft_dir or target_dir
    else:
        where = mtp_weights_dir(target_dir, draft_dir)
    return [
        dataclasses.replace(common, model_dir=where, mtp_layer=i, seed=model.random_seed + 1 + i)
        for i in range(spec.speculative_num_steps or 1)
    ]


def eagle3_aux_layers(config: AerieConfig) -> list[int]:
    """Target layers whose input stream an EAGLE-3 draft reads (none for other algorithms)."""
    spec = config.speculative
    if spec.speculative_algorithm != "EAGLE3":
        return []
    draft = read_arch_config(spec.speculative_draft_model_path or "")
    num_layers = read_arch_config(config.model.model_path or "").num_layers
    return eagle3_aux_layer_ids(draft.raw, num_layers)


def draft_kv_bytes_per_token(config: AerieConfig, dtype: torch.dtype) -> int:
    """KV bytes per slot of all draft pools together (0 without speculation)."""
    spec = config.speculative
    if not spec.enabled:
        return 0
    if spec.speculative_algorithm == "MTP":  # S one-layer runners shaped like the target
        steps = spec.speculative_num_steps
        return mtp_kv_bytes_per_token(config.model.model_path or "", dtype, steps)
    draft = read_arch_config(spec.speculative_draft_model_path or "")
    return kv_bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, dtype)
