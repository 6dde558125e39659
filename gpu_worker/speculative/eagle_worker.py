"""`EagleWorker`: the EAGLE / EAGLE-3 parts of `SpeculativeWorker`'s iteration.

`draft_prefill` (the draft on each target extend's chunk, rotated by one token), `draft_tree`
(S levels of topk branches from the per-row draft state), `compact` and `draft_extend` (the
draft over the fixed S+1 positions, refreshing the draft state at the last accepted one).
Per-row draft state: topk_p, topk_index [rows, topk] (target ids), hidden [rows, H_draft].
"""

from __future__ import annotations

import dataclasses

import torch

from aerie.config import SpeculativeConfig
from gpu_worker import constants
from gpu_worker.kernels.row_commit import DraftState, store_rows
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import (
    STREAM_TOKEN,
    DrawNoise,
    SamplingState,
    column_hashes,
    fixed_flags,
    row_keys,
)
from gpu_worker.speculative.compaction import compaction_moves
from gpu_worker.speculative.draft_layout import (
    draft_cache_locs,
    draft_decode_mask,
    draft_run_positions,
    draft_seq_lens,
)
from gpu_worker.speculative.iteration import SpeculativeWorker
from gpu_worker.speculative.stage_buffers import ExtendInputs
from gpu_worker.speculative.tree import (
    DraftRecord,
    DraftShape,
    DraftTree,
    select_first_level,
    select_next_level,
    tree_from_draft,
)
from gpu_worker.speculative.verify import VerifyResult
from gpu_worker.step.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogitsOutput,
    SpecInput,
    make_batch,
)
from gpu_worker.step.row_state import RowState


def rotate_prefill_inputs(
    input_ids: torch.Tensor, extend_seq_lens: torch.Tensor, tails: torch.Tensor
) -> torch.Tensor:
    """The draft's prefill input: each request's chunk shifted left by one, its tail appended.

    input_ids [num_tokens] (requests' chunks back to back), extend_seq_lens [bs], tails [bs]
    -> [num_tokens]. Draft position p thus pairs the target hidden at p with token p + 1.
    """
    rotated = torch.empty_like(input_ids)
    rotated[:-1] = input_ids[1:]
    rotated[torch.cumsum(extend_seq_lens.long(), 0) - 1] = tails.to(input_ids.dtype)
    return rotated


class EagleWorker(SpeculativeWorker):
    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelRunner,
        draft: ModelRunner,
        sampling: SamplingState,
        state: RowState,
        graph_max_bs: int = 0,
    ) -> None:
        steps = spec.speculative_num_steps or 1
        shape = DraftShape(
            spec.speculative_eagle_topk or 1, steps, spec.speculative_num_draft_tokens or steps + 1
        )
        super().__init__(target, sampling, state, shape)
        self.draft = draft
        self.use_aux = bool(target.aux_hidden_layers)
        rows, device = target.max_running_requests + 1, target.device
        self.topk_p = torch.zeros(rows, self.topk, dtype=torch.float32, device=device)
        self.topk_index = torch.zeros(rows, self.topk, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(rows, draft.config.hidden_size, dtype=target.dtype, device=device)
        # The draft head's tokens in the target's vocabulary, hashed as the sampling noise's
        # columns: a sampled row's coupled proposal perturbs token i as plain sampling does.
        # Without a vocabulary map the draft's head is the target's, over its whole vocabulary.
        head_ids = draft.hot_token_id
        if head_ids is None:
            head_ids = torch.arange(target.vocab_size, device=device)
        self.noise_columns = column_hashes(head_ids)
        self.build_stages([target, draft], graph_max_bs)

    # ------------------------------------------------------------------------------ helpers

    def target_features(self, out: LogitsOutput) -> torch.Tensor:
        """What the draft receives from the target: aux states (EAGLE-3) or the final hidden."""
        return out.aux_hidden_states if self.use_aux else out.hidden_states

    def feature_width(self) -> int:
        layers = len(self.target.aux_hidden_layers or ()) if self.use_aux else 1
        return layers * self.target.config.hidden_size

    def draft_top_k(self, out: LogitsOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's logits [n, V_draft] -> (probs [n, topk] float32, token ids [n, topk] in
        target vocab). A chain (topk 1) runs its draft batches with `greedy_ids` (the runner's
        argmax, already in target ids) and reports probability 1: nothing reads a chain's path
        scores (its tree is fixed), so a softmax would be kernels for nothing."""
        if self.topk == 1:
            ids = out.next_token_ids
            assert ids is not None, "a chain's draft batches ask for greedy_ids"
            return constants.ones_float(ids.shape[0], ids.device)[:, None], ids[:, None]
        probs = torch.softmax(out.next_token_logits.float(), dim=-1)
        topk_p, topk_index = probs.topk(self.topk, dim=-1)
        if self.draft.hot_token_id is not None:
            topk_index = self.draft.hot_token_id[topk_index]
        return topk_p, topk_index

    def row_draft_state(self) -> DraftState:
        return DraftState(self.topk_p, self.topk_index, self.hidden)

    def new_draft_state(self, out: LogitsOutput) -> DraftState:
        """The draft's first-level drafts per request and its pass-back hidden states (all
        tokens': `last` picks each row's)."""
        return DraftState(*self.draft_top_k(out), out.hidden_states)

    def store_draft_state(self, rows: torch.Tensor, out: LogitsOutput, last: torch.Tensor) -> None:
        """Keep each row's first-level drafts and pass-back hidden (last: token index per row)."""
        store_rows(self.row_draft_state(), rows, self.new_draft_state(out), last)

    # ------------------------------------------------------------------------------ stages

    def draft_prefill(
        self,
        batch: ForwardBatch,
        target_out: LogitsOutput,
        tails: torch.Tensor,
        rows_cpu: object = None,
        cached_start: object = None,
    ) -> None:
        """After a target EXTEND: run the draft on the rotated chunks (same positions and slots).

        tails [bs]: per request the token after its chunk (next prompt token, or sampled).
        rows_cpu, cached_start: unused (the draft reads nothing before a chunk, cached or not).
        """
        draft_batch = dataclasses.replace(
            batch,
            mode=ForwardMode.DRAFT_EXTEND,
            input_ids=rotate_prefill_inputs(batch.input_ids, batch.extend_seq_lens, tails),
            spec_info=SpecInput(self.target_features(target_out)),
            greedy_ids=self.topk == 1,
        )
        out = self.draft.forward(draft_batch)
        last = torch.cumsum(batch.extend_seq_lens.long(), 0) - 1  # [bs]
        self.store_draft_state(batch.rows, out, last)

    def draft_tree(
        self,
        rows: torch.Tensor,
        committed_lens: torch.Tensor,
        committed_lens_cpu: list[int],
        bonus: torch.Tensor,
        coupled: bool = False,
    ) -> DraftTree:
        """S draft levels with topk branches from the rows' draft state -> the verify tree.
        Fixed shapes: every draft step runs topk rows per request over the same key layout.
        coupled: a chain proposes for its sampled rows the coupled tokens (`coupled_noise`)."""
        topk, steps = self.topk, self.num_steps
        bs = rows.shape[0]
        record = DraftRecord()
        # A chain's tree is its tokens (`chain_tree`): no path scores, no parents to record.
        chain = self.shape.is_chain
        noise = self.coupled_noise(rows, committed_lens) if coupled and chain else None
        if noise is not None:  # the stored first level is the plain argmax: draw it again
            first = self.draft.next_token_ids(self.hidden[rows], noise(1))
            record.tokens.append(first[:, None])
            input_ids, hidden = first, self.hidden[rows]
        elif chain:
            record.tokens.append(self.topk_index[rows])
            input_ids, hidden = record.tokens[0].flatten(), self.hidden[rows]
        else:
            input_ids, hidden, scores = select_first_level(
                self.topk_p[rows], self.topk_index[rows], self.hidden[rows], record
            )
        cache_locs = draft_cache_locs(
            self.draft.req_to_token_pool.req_to_token, rows, committed_lens, topk, steps
        )  # [S, bs*topk]
        seq_lens = draft_seq_lens(committed_lens, topk, steps)  # [bs], keys each draft row attends
        seq_lens_cpu = [s + topk * steps for s in committed_lens_cpu]
        for step in range(steps - 1):
            batch = make_batch(
                ForwardMode.DRAFT_DECODE,
                input_ids,
                draft_run_positions(committed_lens, topk, step),
                cache_locs[step],
                rows,
                seq_lens_cpu,
                [topk] * bs,
                custom_mask=draft_decode_mask(bs, topk, steps, step, rows.device),
                spec_info=SpecInput(hidden),
                seq_lens=seq_lens,
                extend_seq_lens=constants.full(bs, topk, rows.device),
                greedy_ids=topk == 1,
                draw_noise=None if noise is None else noise(step + 2),
            )
            out = self.draft.forward(batch)
            topk_p, topk_index = self.draft_top_k(out)  # [bs*topk, topk]
            if chain:
                record.tokens.append(topk_index)
                input_ids, hidden = topk_index.flatten(), out.hidden_states
                continue
            input_ids, hidden, scores = select_next_level(
                scores, topk_p, topk_index, out.hidden_states, step + 1, record
            )
        return tree_from_draft(record, bonus, committed_lens, self.shape)

    def coupled_noise(self, rows: torch.Tensor, committed_lens: torch.Tensor):
        """depth -> the `DrawNoise` of the rows' chain drafts at that depth: a sampled row
        proposes argmax(logits / T + the noise plain sampling adds to the token at position
        committed_len + depth), which is the target's own draw there whenever the draft's
        distribution matches the target's (acceptance draws exactly that token); a greedy
        row proposes its argmax. Output does not depend on it, only acceptance."""
        params = self.sampling.gather(rows, flags=fixed_flags(sort=False))
        greedy = params.greedy
        scale = torch.where(greedy, 1.0, 1.0 / params.temperature.clamp(min=1e-6))
        depths = constants.arange(self.num_steps + 1, rows.device)  # keys of every depth at once
        positions = committed_lens.long()[None, :] + depths[:, None]  # [S+1, bs]
        keys = row_keys(params.seed[None, :], positions, STREAM_TOKEN)  # rows contiguous

        def at(depth: int) -> DrawNoise:
            return DrawNoise(scale, keys[depth], ~greedy, self.noise_columns)

        return at

    def compact(
        self, result: VerifyResult, rows: torch.Tensor, committed_lens: torch.Tensor
    ) -> None:
        """Move the accepted path's target KV to positions prefix .. prefix + accept_len - 1."""
        if self.topk == 1:  # a chain: node k already sits at position prefix + k
            return
        dst, src = compaction_moves(
            result,
            committed_lens,
            self.target.req_to_token_pool.req_to_token,
            rows,
            self.num_draft_tokens,
            self.num_steps,
        )
        self.target.kv_pool.move_kv(dst, src)

    def draft_extend(
        self, inputs: ExtendInputs, committed_lens_cpu: list[int]
    ) -> tuple[DraftState, torch.Tensor]:
        """The draft over positions prefix .. prefix+S: position prefix + k pairs the target
        feature of accepted node k with the token that follows it; the rows' draft state is read
        at position prefix + accept_len - 1 (what runs past it is overwritten next step)."""
        rows, committed_lens, accept_lens = inputs.rows, inputs.committed_lens, inputs.accept_lens
        bs, width = rows.shape[0], self.num_steps + 1
        offsets = constants.arange(width, rows.device)
        positions = committed_lens[:, None] + offsets  # [bs, S+1]
        slots = self.draft.req_to_token_pool.req_to_token[rows[:, None], positions]
        starts = constants.cached(  # each request's first token, less one
            ("extend_starts", bs, width),
            rows.device,
            lambda: torch.arange(bs, device=rows.device) * width - 1,
        )
        last = starts + accept_lens  # [bs]
        batch = make_batch(
            ForwardMode.DRAFT_EXTEND,
            inputs.tokens.flatten(),
            positions.flatten(),
            slots.flatten(),
            rows,
            [s + width for s in committed_lens_cpu],
            [width] * bs,
            spec_info=SpecInput(inputs.features.flatten(0, -2)),
            seq_lens=committed_lens + width,
            extend_seq_lens=constants.full(bs, width, rows.device),
            logits_indices=last,
            greedy_ids=self.topk == 1,
        )
        return self.new_draft_state(self.draft.forward(batch)), last
