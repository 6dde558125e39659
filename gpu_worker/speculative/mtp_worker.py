"""`MTPWorker`: multi-layer EAGLE (a chain), one draft runner per MTP layer.

MTP layer k at position p reads (target hidden h_p, token t_{p+1+k}) and predicts t_{p+2+k};
every forward of layer k runs on runner k. Prefill chunks and the draft extend run the same
windows of the stack, as tensors (`docs/speculation.md`, "Multi-layer EAGLE (MTP)").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aerie.config import SpeculativeConfig
from gpu_worker import constants
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import SamplingState
from gpu_worker.speculative.iteration import SpeculativeWorker
from gpu_worker.speculative.stage_buffers import ExtendInputs
from gpu_worker.speculative.tree import DraftShape, DraftTree, chain_tree
from gpu_worker.step.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogitsOutput,
    SpecInput,
    make_batch,
)
from gpu_worker.step.host_batch import Staging
from gpu_worker.step.row_state import RowState


@dataclass(frozen=True)
class StackWindow:
    """The positions one MTP layer runs for every request, tokens back to back.

    token_req / positions [n]: each token's batch index and position; last [bs]: the index of
    each request's position end-1 (its prediction); seq_lens / extend_lens [bs] on the device
    and seq_cpu / extend_cpu on the host (KV length after the forward, tokens run)."""

    token_req: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_cpu: list[int]
    extend_cpu: list[int]


def fixed_window(
    committed_lens: torch.Tensor,
    accept_lens: torch.Tensor,
    committed_lens_cpu: list[int],
    layer: int,
    steps: int,
) -> StackWindow:
    """Layer `layer`'s window after a verify: S+1+layer positions from max(prefix - layer, 0),
    which covers [prefix - layer, prefix + accept_len). Device arithmetic only."""
    bs, length = committed_lens.shape[0], steps + 1 + layer
    device = committed_lens.device
    first = (committed_lens - layer).clamp(min=0)  # [bs]
    offsets = constants.arange(length, device)
    batch_index = constants.arange(bs, device)
    return StackWindow(
        token_req=batch_index[:, None].expand(bs, length).flatten(),
        positions=(first[:, None] + offsets).flatten(),
        last=batch_index * length + committed_lens + accept_lens - 1 - first,
        seq_lens=first + length,
        extend_lens=constants.full(bs, length, device),
        seq_cpu=[max(s - layer, 0) + length for s in committed_lens_cpu],
        extend_cpu=[length] * bs,
    )


def ragged_windows(
    starts: np.ndarray, ends: np.ndarray, steps: int, floors: np.ndarray | None = None
) -> list[list[np.ndarray]]:
    """Every layer's window over [max(start - k, floor), end) for a prefill chunk, as host
    arrays in `StackWindow` order (token_req, positions, last, seq_lens, extend_lens). floors
    [bs] (default 0): where each request's reused cached prefix ends (its KV there is shared
    and already right)."""
    windows = []
    floors = np.zeros_like(starts) if floors is None else floors
    for layer in range(steps):
        first = np.maximum(starts - layer, floors)
        lens = ends - first
        positions = np.concatenate([np.arange(f, e) for f, e in zip(first, ends, strict=True)])
        windows.append(
            [np.repeat(np.arange(len(lens)), lens), positions, np.cumsum(lens) - 1, ends, lens]
        )
    return windows


class MTPWorker(SpeculativeWorker):
    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelRunner,
        draft_runner_list: list[ModelRunner],
        sampling: SamplingState,
        state: RowState,
        graph_max_bs: int = 0,
    ) -> None:
        steps = len(draft_runner_list)
        if spec.speculative_num_steps != steps:
            raise ValueError("one MTP runner per draft step is required")
        super().__init__(target, sampling, state, DraftShape(1, steps, steps + 1))
        self.draft_runner_list = draft_runner_list
        rows, device = target.max_running_requests + 1, target.device
        hidden_size = target.config.hidden_size
        self.chain = torch.zeros(rows, steps, dtype=torch.int64, device=device)
        # Target hidden at the last `stash_width` committed positions (oldest first), per row.
        self.stash_width = max(steps - 1, 1)
        self.stash = torch.zeros(
            rows, self.stash_width, hidden_size, dtype=target.dtype, device=device
        )
        self.staging = Staging(device)  # a prefill's window arrays go over in one copy
        # Per row, where the cached prefix it started on ends: prefill windows never reach
        # back before it (that KV is shared, and the stash holds nothing of it).
        self.cached_len = np.zeros(rows, dtype=np.int64)
        self.build_stages([target, *draft_runner_list], graph_max_bs)

    def target_features(self, out: LogitsOutput) -> torch.Tensor:
        return out.hidden_states

    def feature_width(self) -> int:
        return self.target.config.hidden_size

    # ------------------------------------------------------------------------------ the stack

    def run_stack(
        self,
        rows: torch.Tensor,
        starts: torch.Tensor,
        line: torch.Tensor,
        known_lens: torch.Tensor,
        hidden: torch.Tensor,
        hidden_offsets: torch.Tensor,
        windows: list[StackWindow],
    ) -> None:
        """Run every MTP layer over its window after positions [start, start + known_len) were
        committed (`docs/speculation.md`, MTP); updates the rows' chain and hidden stash.

        rows, starts, known_lens, hidden_offsets [bs]; line [bs, W] int64 (t_{start+1}, ...;
        predictions are written into it); hidden [N, H]: the target hidden of position
        start + j of request b at row hidden_offsets[b] + j.
        """
        bs, width = line.shape
        sw = self.stash_width
        batch_index = constants.arange(bs, rows.device)
        # One table for both sources: the stashed rows first, then this step's hidden.
        table = torch.cat((self.stash[rows].flatten(0, 1), hidden.to(self.stash.dtype)))

        def hidden_rows(req: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            rel = positions - starts[req]  # < 0: before start, in the stash
            # Positions past the new end (fixed windows) compute garbage: any row will do.
            new = (bs * sw + hidden_offsets[req] + rel).clamp(max=table.shape[0] - 1)
            return torch.where(rel >= 0, new, req * sw + (rel + sw).clamp(min=0))

        for layer, (runner, window) in enumerate(zip(self.draft_runner_list, windows, strict=True)):
            req, positions = window.token_req, window.positions
            column = (positions + layer - starts[req]).clamp(0, width - 1)
            slots = runner.req_to_token_pool.req_to_token[rows[req], positions]
            batch = make_batch(
                ForwardMode.DRAFT_EXTEND,
                line[req, column],
                positions,
                slots,
                rows,
                window.seq_cpu,
                window.extend_cpu,
                spec_info=SpecInput(table[hidden_rows(req, positions)]),
                seq_lens=window.seq_lens,
                extend_seq_lens=window.extend_lens,
                logits_indices=window.last,
                greedy_ids=True,
            )
            prediction = runner.forward(batch).next_token_ids  # [bs]
            self.chain[rows, layer] = prediction
            column = (known_lens + layer).clamp(max=width - 1)[:, None]
            line.scatter_(1, column, prediction[:, None])
        ends = starts + known_lens
        recent = ends[:, None] - sw + constants.arange(sw, rows.device)  # [bs, sw]
        req = batch_index[:, None].expand(bs, sw)
        self.stash[rows] = table[hidden_rows(req, recent)]

    # ------------------------------------------------------------------------------ stages

    def draft_prefill(
        self,
        batch: ForwardBatch,
        target_out: LogitsOutput,
        tails: torch.Tensor,
        rows_cpu: np.ndarray | None = None,
        cached_start: np.ndarray | None = None,
    ) -> None:
        """After a target EXTEND: run the stack over each request's chunk (ragged windows).
        rows_cpu [bs] host rows; cached_start [bs] host bool: the row is new and starts on a
        cached prefix (both None: no request does)."""
        lens = np.asarray(batch.extend_seq_lens_cpu, dtype=np.int64)
        starts = np.asarray(batch.committed_lens_cpu, dtype=np.int64)
        host_rows = batch.rows.cpu().numpy() if rows_cpu is None else rows_cpu
        fresh = starts == 0 if cached_start is None else (starts == 0) | cached_start
        self.cached_len[host_rows[fresh]] = starts[fresh]
        bs, width = len(lens), int(lens.max()) + self.num_steps
        offsets = np.cumsum(lens) - lens
        # line[b, i] = t_{start+1+i}: the chunk shifted left by one, then the tail.
        req = np.repeat(np.arange(bs), lens - 1)
        within = np.concatenate([np.arange(n - 1) for n in lens])
        windows = ragged_windows(starts, starts + lens, self.num_steps, self.cached_len[host_rows])
        uploaded = self.staging.upload(
            [req, within, offsets, starts, lens, *[a for w in windows for a in w]]
        )
        dev_req, dev_within, dev_offsets, dev_starts, dev_lens = uploaded[:5]
        line = torch.zeros(bs, width, dtype=torch.int64, device=tails.device)
        line[dev_req, dev_within] = batch.input_ids[dev_offsets[dev_req] + dev_within + 1]
        line[torch.arange(bs, device=tails.device), dev_lens - 1] = tails.long()
        stack_windows = [
            StackWindow(
                *uploaded[5 + 5 * k : 10 + 5 * k], seq_cpu=w[3].tolist(), extend_cpu=w[4].tolist()
            )
            for k, w in enumerate(windows)
        ]
        self.run_stack(
            batch.rows,
            dev_starts,
            line,
            dev_lens,
            target_out.hidden_states,
            dev_offsets,
            stack_windows,
        )

    def draft_tree(
        self,
        rows: torch.Tensor,
        committed_lens: torch.Tensor,
        committed_lens_cpu: list[int],
        bonus: torch.Tensor,
        coupled: bool = False,
    ) -> DraftTree:
        """The chain the stack left for these rows, after the bonus token (always its layers'
        argmax: MTP does not couple its proposals yet)."""
        return chain_tree(bonus, self.chain[rows], committed_lens, self.num_steps)

    def draft_extend(self, inputs: ExtendInputs, committed_lens_cpu: list[int]) -> None:
        """The stack over the accepted positions, in fixed windows."""
        rows, committed_lens, accept_lens = inputs.rows, inputs.committed_lens, inputs.accept_lens
        bs, steps = rows.shape[0], self.num_steps
        line = torch.zeros(bs, 2 * steps + 1, dtype=torch.int64, device=rows.device)
        line[:, : steps + 1] = inputs.tokens
        windows = [
            fixed_window(committed_lens, accept_lens, committed_lens_cpu, k, steps)
            for k in range(steps)
        ]
        offsets = constants.arange(bs, rows.device) * (steps + 1)
        self.run_stack(
            rows,
            committed_lens,
            line,
            accept_lens,
            inputs.features.flatten(0, -2),
            offsets,
            windows,
        )
