"""Start-up warm-up: the eager paths' Triton kernels compiled before the first request.

`run_warm_up` runs extend steps of dummy requests over every specialization an eager forward
can meet (`docs/gpu.md`, "No compile while serving"), on rows and slots free at start-up;
`watch_compiles` then logs every later compile as a warning naming the kernel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aerie.codec import pack_ids, unpack_ids
from aerie.messages import ForwardPlan, RequestStart, SamplingParams
from aerie.plans import extend_plan
from gpu_worker.attention.triton import TritonBackend
from gpu_worker.kernels import extend_attention
from gpu_worker.kernels.few_query_attention import MAX_ROWS, fits

if TYPE_CHECKING:
    from gpu_worker.worker import GPUWorker

log = logging.getLogger(__name__)

SHORT, LONG, PREFIX_EXTEND = 5, 40, 3  # chunk lengths: a 16-token query block, a 64-token one
FEW_ROWS = 2  # within pdl.MAX_ROWS: the fused projections' launch for 2-4 rows


def warm_up_plans(
    num_rows: int, page_size: int, vocab_size: int, draft_lengths: Sequence[int] = ()
) -> list[ForwardPlan]:
    """The warm-up's extend plans on request rows 1 (and 2 where num_rows > 1), then one
    single-chunk plan on row 1 of FEW_ROWS tokens and one per other length of `draft_lengths`.
    Each request writes its own page-aligned run of KV slots (position p of a run starting at
    s in slot s + p), after the reserved page 0."""
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    next_slot = page_size

    def run_of(n: int) -> int:
        nonlocal next_slot
        start = -(-next_slot // page_size) * page_size
        next_slot = start + n
        return start

    def chunk(row: int, run: int, prefix: int, length: int) -> tuple:
        ids = [(7 * (prefix + i) + row) % vocab_size for i in range(length)]
        return (row, prefix, ids, list(range(run + prefix, run + prefix + length)), True)

    short, long = run_of(SHORT), run_of(LONG + PREFIX_EXTEND)
    chunks = [[chunk(1, short, 0, SHORT)], [chunk(1, long, 0, LONG)]]
    if num_rows > 1:  # row 1 extends its cached LONG tokens; row 2 starts a long chunk
        second = run_of(LONG + 1)
        chunks.append([chunk(1, long, LONG, PREFIX_EXTEND), chunk(2, second, 0, LONG + 1)])
    lengths = [FEW_ROWS, *(n for n in draft_lengths if n != FEW_ROWS)]
    chunks += [[chunk(1, run_of(n), 0, n)] for n in lengths]

    def starts(plan: list[tuple]) -> list[RequestStart]:
        return [RequestStart(c[0], greedy, False, pack_ids(c[2])) for c in plan if c[1] == 0]

    return [extend_plan(-1 - i, plan, starts(plan)) for i, plan in enumerate(chunks)]


def draft_prefill_lengths(worker: GPUWorker) -> list[int]:
    """Chunk lengths whose draft prefill runs the few-query attention kernel: a batch of
    equal chunks that fit its tile does, and the chunk length is one of its constexprs, so
    each length is a compile of its own."""
    lengths: set[int] = set()
    for runner in worker.draft_runner_list:
        backend = runner.attn_backend
        if isinstance(backend, TritonBackend):
            lengths |= {
                n
                for n in range(1, MAX_ROWS + 1)
                if fits(n, backend.num_heads, backend.num_kv_heads)
            }
    return sorted(lengths)


def run_warm_up(worker: GPUWorker) -> float | None:
    """Run the warm-up plans on `worker` (every tensor-parallel rank runs the same ones), on
    two request rows or, where the KV pool is too small for that, one; returns the seconds
    they took, or None where the pool or the context length is too small for them."""
    runner = worker.runner
    if runner.context_length <= LONG + PREFIX_EXTEND + 1:
        log.info("start-up warm-up skipped: the context length is %d tokens", runner.context_length)
        return None
    lengths = draft_prefill_lengths(worker)
    for rows in sorted({min(2, worker.max_running_requests), 1}, reverse=True):
        plans = warm_up_plans(rows, runner.page_size, runner.vocab_size, lengths)
        if max(max(unpack_ids(p.slots)) for p in plans) < runner.max_total_tokens:
            break
    else:
        log.info("start-up warm-up skipped: the KV pool holds %d tokens", runner.max_total_tokens)
        return None
    # The rows and slots are free at start-up; a request that later runs on them starts afresh
    # (RequestStart resets the row's sampling state, its first extend the row's device state,
    # and it reads only KV slots it wrote).
    began = time.perf_counter()
    # The prefill graphs compiled their kernels when captured: the plans take the eager path.
    graphs, worker.prefill_graphs = worker.prefill_graphs, None
    try:
        # The extend kernel's key split count is a constexpr chosen from the batch's shape:
        # the plans run once per count it can take.
        for splits in extend_attention.SPLIT_COUNTS:
            extend_attention.FORCED_SPLITS = splits
            for plan in plans:
                worker.execute(plan)
    finally:
        worker.prefill_graphs = graphs
        extend_attention.FORCED_SPLITS = None
    return time.perf_counter() - began


def watch_compiles(on_build: Callable[[], None] | None = None) -> bool:
    """From now on, log a warning for every Triton kernel built in this process (compiled, or
    loaded from Triton's cache), and call on_build after each. Returns whether this Triton
    version has the hook."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False

    def warn(**kwargs) -> None:
        log.warning(
            "Triton built a kernel while serving, so this step waited for it: %s (a "
            "specialization the start-up warm-up did not meet)",
            str(kwargs.get("repr", kwargs.get("key", "?")))[:300],
        )
        if on_build is not None:
            on_build()

    runtime.jit_post_compile_hook = warn
    return True
