"""`MTPWorker`: multi-layer EAGLE with a draft runner list, one runner per MTP layer (chain).

MTP layer k at position p reads (target hidden h_p, token t_{p+1+k}) and predicts t_{p+2+k}.
`draft_runner_list[k]` holds layer k with its own KV pool and its own req_to_token_pool (the
same slot ids as every other runner); every forward of layer k, prefill and draft extend
alike, runs on runner k (DESIGN §5.3, SGLang PR #22954).

One mechanism covers prefill chunks and the draft extend after verify ("run the stack"): when
positions [start, end) become committed, with the true tokens t_{start+1} .. t_{end} known,
layer k runs over the window [start - k, end). Its token at position p is t_{p+1+k}: a true
token while p + 1 + k <= end, else the prediction of layer p + k - end made in this same run
(layer 0's prediction d_1 = t_{end+1}, and so on: runner k sees the input rotated once more
than runner k-1, with runner k-1's prediction appended). The k positions before `start` are
recomputed because last time their tokens were predictions (after a non-final prefill chunk,
guesses for prompt tokens the worker had not seen): layers >= 1 thus replace stale boundary
KV with KV from the true tokens.
Their target hidden states come from a per-row stash of the last S-1 committed positions.

Each layer's last row gives the chain for the next decode step: d_1 .. d_S after the bonus
token t_end. The decode step verifies that chain (a tree of ND = S+1 nodes), accepts, and
runs the stack over the accepted positions. No compaction is needed: a chain's node k already
sits at position seq + k.
"""

from __future__ import annotations

import torch

from aerie.config import SpeculativeConfig
from gpu_worker.forward_batch import ForwardBatch, ForwardMode, SpecInput, make_batch
from gpu_worker.model_runner import LogitsOutput, ModelRunner
from gpu_worker.sampling import SamplingState
from gpu_worker.speculative.target_verify import (
    SpecStepOutput,
    accepted_rows,
    verify_and_accept,
)
from gpu_worker.speculative.tree import build_tree


class MTPWorker:
    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelRunner,
        draft_runner_list: list[ModelRunner],
        sampling: SamplingState,
    ) -> None:
        self.num_steps = len(draft_runner_list)
        if spec.speculative_num_steps != self.num_steps:
            raise ValueError("one MTP runner per draft step is required")
        self.target, self.draft_runner_list, self.sampling = target, draft_runner_list, sampling
        rows, device = target.max_running_requests + 1, target.device
        hidden_size = target.config.hidden_size
        self.chain = torch.zeros(rows, self.num_steps, dtype=torch.int64, device=device)
        # Target hidden at the last S-1 committed positions (oldest first), per request row.
        self.stash = torch.zeros(
            rows, max(self.num_steps - 1, 1), hidden_size, dtype=target.dtype, device=device
        )

    # ------------------------------------------------------------------------------ the stack

    def run_stack(
        self,
        rows: list[int],
        starts: list[int],
        hidden: torch.Tensor,
        known: list[list[int]],
    ) -> None:
        """Run every MTP layer over its window after positions [start, start + len(known))
        were committed (see the module docstring).

        rows/starts: per request; hidden [sum(len(known)), H]: target hidden at the new
        positions, request by request; known[b]: t_{start+1} .. t_{end}.
        """
        device = self.target.device
        ends = [s + len(k) for s, k in zip(starts, known, strict=True)]
        offsets = torch.tensor([0, *[len(k) for k in known]]).cumsum(0).tolist()
        predictions: list[list[int]] = [[] for _ in rows]
        for layer, runner in enumerate(self.draft_runner_list):
            ids, positions, sources, lens = [], [], [], []
            for b, (row, start, end) in enumerate(zip(rows, starts, ends, strict=True)):
                first = max(0, start - layer)
                for p in range(first, end):
                    t = p + 1 + layer  # the position whose token layer `layer` reads at p
                    if t <= end:
                        ids.append(known[b][t - start - 1])
                    else:  # predicted by layer t - end - 1 in this run
                        ids.append(predictions[b][t - end - 1])
                    positions.append(p)
                    sources.append(self._hidden_source(b, row, p, start, offsets))
                lens.append(end - first)
            features = self._gather_hidden(hidden, sources, device)
            row_t = torch.tensor(rows, device=device)
            pos_t = torch.tensor(positions, device=device)
            slots = runner.req_to_token_pool.req_to_token[row_t.repeat_interleave(
                torch.tensor(lens, device=device)), pos_t]
            batch = make_batch(
                ForwardMode.DRAFT_EXTEND, torch.tensor(ids, device=device), pos_t, slots, row_t,
                ends, lens, spec_info=SpecInput(features),
            )
            out = runner.forward(batch)
            tokens = out.next_token_logits.argmax(dim=-1)  # [bs]
            self.chain[row_t, layer] = tokens
            for b, token in enumerate(tokens.tolist()):
                predictions[b].append(token)
        self._update_stash(rows, starts, ends, hidden, offsets)

    def _hidden_source(self, b: int, row: int, p: int, start: int, offsets: list[int]):
        """Where the target hidden of position p comes from: ("new", index) or ("stash", row,
        index) for the S-1 positions before `start`."""
        if p >= start:
            return ("new", offsets[b] + p - start)
        return ("stash", row, p - start + self.stash.shape[1])

    def _gather_hidden(self, hidden: torch.Tensor, sources: list, device) -> torch.Tensor:
        """[len(sources), H] rows from this step's hidden or the stash, in order."""
        new = torch.tensor([s[1] if s[0] == "new" else -1 for s in sources], device=device)
        stash_rows = torch.tensor([s[1] if s[0] == "stash" else 0 for s in sources], device=device)
        stash_idx = torch.tensor([s[2] if s[0] == "stash" else 0 for s in sources], device=device)
        from_stash = self.stash[stash_rows, stash_idx]  # [n, H]
        from_new = hidden[new.clamp_min(0)]
        return torch.where((new >= 0)[:, None], from_new, from_stash)

    def _update_stash(self, rows, starts, ends, hidden, offsets) -> None:
        """Keep the target hidden of each row's last S-1 committed positions."""
        width = self.stash.shape[1]
        for b, (row, start, end) in enumerate(zip(rows, starts, ends, strict=True)):
            sources = [self._hidden_source(b, row, p, start, offsets)
                       for p in range(end - width, end)]
            self.stash[row] = self._gather_hidden(hidden, sources, hidden.device)

    # ------------------------------------------------------------------------------ stages

    def draft_prefill(
        self, batch: ForwardBatch, target_out: LogitsOutput, tails: torch.Tensor
    ) -> None:
        """After a target EXTEND: run the stack over each request's chunk."""
        ids = batch.input_ids.tolist()
        known, offset = [], 0
        for n, tail in zip(batch.extend_seq_lens_cpu, tails.tolist(), strict=True):
            known.append(ids[offset + 1 : offset + n] + [tail])
            offset += n
        self.run_stack(
            batch.req_pool_indices.tolist(), batch.extend_prefix_lens_cpu,
            target_out.hidden_states, known,
        )

    def decode(
        self, rows: torch.Tensor, seq_cpu: list[int], bonus: torch.Tensor, want_logprobs: bool
    ) -> SpecStepOutput:
        """Verify the rows' chains, accept, and run the stack over the accepted positions."""
        steps = self.num_steps
        seq_lens = torch.tensor(seq_cpu, dtype=torch.int64).to(rows.device, non_blocking=True)
        bs = rows.shape[0]
        chain_parents = torch.arange(-1, steps - 1, device=rows.device).expand(bs, steps)
        tree = build_tree(
            bonus, chain_parents, torch.arange(steps, device=rows.device).expand(bs, steps),
            self.chain[rows], seq_lens, 1, steps, steps + 1,
        )
        result, verify_out, step = verify_and_accept(
            self.target, self.sampling, tree, rows, seq_lens, seq_cpu, want_logprobs
        )
        accept, tokens = result.accept_lens.tolist(), step.tokens.tolist()
        known = [tokens[b][: accept[b]] for b in range(bs)]
        hidden = accepted_rows(verify_out.hidden_states, result)
        self.run_stack(rows.tolist(), seq_cpu, hidden, known)
        return step
