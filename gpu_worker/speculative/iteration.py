"""`SpeculativeWorker`: the decode iteration every draft algorithm shares, in fixed shapes.

propose (draft tree, verify, greedy acceptance) -> accept (an accept stage, for batches that
are not plain greedy) -> compact (topk > 1) -> draft extend, each a `StageGraph` that hands the
next a `stage_buffers` dataclass in place; no stage reads the device from the host
(`docs/speculation.md`, "The iteration").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from gpu_worker.graphs.stage_graph import PER_REQUEST, DirectStage, StageGraph, tensor_fields
from gpu_worker.kernels.greedy_accept import greedy_accept, greedy_accept_reference
from gpu_worker.kernels.row_commit import DraftState, commit_rows, commit_rows_reference
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import SamplingState, fixed_flags
from gpu_worker.speculative.stage_buffers import (
    Accepted,
    AcceptInputs,
    ExtendInputs,
    GreedyProposal,
    Proposal,
    ProposeInputs,
    accept_specs,
    extend_specs,
    tree_fields,
)
from gpu_worker.speculative.target_verify import SpecStepOutput, accept_and_read, verify_tree
from gpu_worker.speculative.tree import DraftShape, DraftTree
from gpu_worker.speculative.verify import VerifyResult
from gpu_worker.step.row_state import RowState

# The accept stage's variants and the sampling stages each runs (`fixed_flags`). "penalize"
# runs them all, so a penalised greedy batch walks the sampling path too (one-hot probs: the
# same tokens), a few more eager kernels for a rare combination.
ACCEPT_FLAGS = {
    "sample": fixed_flags(sort=False, penalties=False),
    "filter": fixed_flags(sort=True, penalties=False),
    "penalize": fixed_flags(sort=True, penalties=True),
}
GRAPHED_ACCEPT = ("sample", "filter")
# The most tree nodes (batch x ND) an accept graph is captured for: its sampling temporaries,
# a few float32 [nodes, V] copies, a sort and int64 indices, stay in the graph pool (budgeted
# as `RunnerSpec.graph_sampled_rows`). Larger batches replay the same stage eagerly, where the
# GPU's work hides the host's launches.
ACCEPT_GRAPH_ROWS = 256


class SpeculativeWorker:
    """Subclasses implement `draft_tree` (the proposal), `draft_extend` (after acceptance),
    `target_features` and `draft_prefill`, then call `build_stages`."""

    def __init__(
        self, target: ModelRunner, sampling: SamplingState, state: RowState, shape: DraftShape
    ) -> None:
        self.target, self.sampling, self.state, self.shape = target, sampling, state, shape
        self.num_steps, self.topk = shape.num_steps, shape.topk
        self.num_draft_tokens = shape.num_draft_tokens
        # On the triton backend greedy acceptance and the row commit are one Triton launch each
        # (the torch functions are their references); acceptance writes the extend stage's
        # inputs in place once they exist.
        self.use_triton = target.spec.attention_backend == "triton"
        self.greedy_buffers: Accepted | None = None

    # ------------------------------------------------------------------------ subclass API

    def draft_tree(
        self,
        rows: torch.Tensor,
        committed_lens: torch.Tensor,
        committed_lens_cpu: list[int],
        bonus: torch.Tensor,
        coupled: bool = False,
    ) -> DraftTree:
        """The draft's proposal; coupled: the batch may hold sampled rows, for which a draft
        that can proposes the tokens coupled to the target's draws (`EagleWorker`)."""
        raise NotImplementedError

    def draft_extend(
        self, inputs: ExtendInputs, committed_lens_cpu: list[int]
    ) -> tuple[DraftState, torch.Tensor] | None:
        """-> the rows' new draft state (top-k per request, hidden states read at `last` [bs])
        for `commit` to store, or None where the draft keeps its own (MTP)."""
        raise NotImplementedError

    def row_draft_state(self) -> DraftState:
        """The per-row draft state `draft_extend`'s result is stored into."""
        raise NotImplementedError

    def target_features(self, out) -> torch.Tensor:
        raise NotImplementedError

    def compact(
        self, result: VerifyResult, rows: torch.Tensor, committed_lens: torch.Tensor
    ) -> None:
        """Move the accepted path's target KV into place (only trees need it)."""

    # ------------------------------------------------------------------------ the stages

    def build_stages(self, runners: list[ModelRunner], graph_max_bs: int) -> None:
        """The propose, accept and extend stages: graphed for batches up to graph_max_bs
        (captured on CUDA when every runner's attention backend can be), or direct calls when
        0. The propose stage writes a greedy batch's extend inputs into the extend stage's
        buffers and the tree, logits and features into the accept stages' (shared) buffers;
        an accept stage writes its extend inputs over the greedy ones."""
        accept = {
            name: functools.partial(self._accept, flags) for name, flags in ACCEPT_FLAGS.items()
        }
        self.graph_pool = None
        if graph_max_bs <= 0:
            direct = DirectStage(functools.partial(self.propose, True))
            self.propose_stages = {"greedy": direct, "accept": direct}
            self.accept_stages = {name: DirectStage(fn) for name, fn in accept.items()}
            self.extend_stage = DirectStage(self._extend)
            return
        width, nd, features = self.num_steps + 1, self.num_draft_tokens, self.feature_width()
        device = self.target.device
        capture = device.type == "cuda" and all(r.attn_backend.supports_cuda_graph for r in runners)
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.graph_pool = pool  # (adaptive speculation's plain decode step captures into it)
        self.extend_stage = StageGraph(
            "draft extend",
            self._extend,
            ExtendInputs,
            extend_specs(width, features, self.target.dtype),
            graph_max_bs,
            device,
            capture=False,
        )
        into = self.extend_stage.inputs
        self.greedy_buffers = into.accepted()
        # The first graphed variant owns the buffers of the tree, logits and features, the
        # extend stage those of the rows and lengths; every graphed variant reads them all.
        shared = {"rows": into.rows, "committed_lens": into.committed_lens}
        specs = accept_specs(nd, self.target.vocab_size, features, self.target.dtype)
        self.accept_stages: dict[str, StageGraph | DirectStage] = {}
        for name in GRAPHED_ACCEPT:
            self.accept_stages[name] = stage = StageGraph(
                f"accept, {name}",
                accept[name],
                AcceptInputs,
                specs,
                graph_max_bs,
                device,
                capture=False,
                output_buffers=self.greedy_buffers,
                input_buffers=shared,
                capture_max_bs=ACCEPT_GRAPH_ROWS // nd,
            )
            shared = tensor_fields(stage.inputs)
        self.accept_stages["penalize"] = DirectStage(accept["penalize"])
        # Two captures of the one propose function: a greedy batch's graph writes only the
        # extend stage's inputs; the other also hands the tree, logits and features (a dozen
        # copies, one of [bs * ND, V] floats) to whichever accept stage runs next.
        greedy = GreedyProposal(
            into.rows, into.committed_lens, into.accept_lens, into.tokens, into.features, None, None
        )
        chained = Proposal(
            **shared,
            greedy_accept_lens=into.accept_lens,
            greedy_tokens=into.tokens,
            greedy_features=into.features,
            greedy_predict=None,
            greedy_accept_index=None,
        )
        self.propose_stages = {
            variant: StageGraph(
                f"draft and verify, {variant}",
                functools.partial(self.propose, variant == "accept"),
                ProposeInputs,
                {"rows": PER_REQUEST},
                graph_max_bs,
                device,
                capture,
                pool,
                output_buffers=buffers,
            )
            for variant, buffers in (("greedy", greedy), ("accept", chained))
        }
        if capture:
            self.extend_stage.capture_all(pool)
            for name in GRAPHED_ACCEPT:
                self.accept_stages[name].capture_all(pool)

    def feature_width(self) -> int:
        """Width of the target feature the draft reads per token."""
        raise NotImplementedError

    def propose(
        self, for_accept: bool, bs: int, inputs: ProposeInputs, committed_lens_cpu: list[int]
    ) -> GreedyProposal | Proposal:
        """The draft's tree and the target's verify forward over it (one stage), for the rows'
        committed lengths and last tokens in `RowState`, accepted greedily; for_accept: also
        the tree, logits and features an accept stage reads."""
        rows = inputs.rows
        committed_lens, bonus = self.state.committed_lens[rows], self.state.tokens[rows]
        tree = self.draft_tree(rows, committed_lens, committed_lens_cpu, bonus, for_accept)
        out = verify_tree(
            self.target, tree, rows, committed_lens, committed_lens_cpu, not for_accept
        )
        features = self.target_features(out)
        # Greedy acceptance without penalties needs nothing from the host: done here, in the
        # graph, and used whenever the whole batch is plain greedy.
        target_predict = out.next_token_logits.argmax(dim=-1) if for_accept else out.next_token_ids
        predict, accept_index, accept_lens, emitted, path_features = self.accept_greedy(
            tree, target_predict, features
        )
        if self.topk == 1:  # a chain's KV stays; a tree's accepted path moves (`compact`)
            predict = accept_index = None
        if not for_accept:
            return GreedyProposal(
                rows, committed_lens, accept_lens, emitted, path_features, predict, accept_index
            )
        assert tree.ancestors is not None
        return Proposal(
            rows=rows,
            committed_lens=committed_lens,
            **tree_fields(tree),
            logits=out.next_token_logits,
            features=features,
            greedy_accept_lens=accept_lens,
            greedy_tokens=emitted,
            greedy_features=path_features,
            greedy_predict=predict,
            greedy_accept_index=accept_index,
        )

    def accept_greedy(
        self, tree: DraftTree, target_predict: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(predict, accept_index, accept_lens, tokens, features along the path), as
        `greedy_accept` returns them: one launch on the triton backend, writing into the
        extend stage's input buffers when the batch fits them."""
        if not self.use_triton:
            return greedy_accept_reference(tree, target_predict, features)
        bs, buffers = target_predict.shape[0] // self.num_draft_tokens, self.greedy_buffers
        out = None
        if buffers is not None and bs <= buffers.accept_lens.shape[0]:
            out = Accepted(buffers.accept_lens[:bs], buffers.tokens[:bs], buffers.features[:bs])
        return greedy_accept(tree, target_predict, features, out)

    def _extend(self, bs: int, inputs: ExtendInputs, committed_lens_cpu: list[int]) -> None:
        """The draft extend, then each row's committed length and last token advance (and its
        draft state is stored: in one launch on the triton backend)."""
        new = self.draft_extend(inputs, committed_lens_cpu)
        rows, accept_lens, tokens = inputs.rows, inputs.accept_lens, inputs.tokens
        if new is None:
            self.state.commit_accepted(rows, accept_lens, tokens)
        else:
            commit = commit_rows if self.use_triton else commit_rows_reference
            commit(self.state, self.row_draft_state(), rows, accept_lens, tokens, *new)

    # ------------------------------------------------------------------------ an iteration

    def decode(
        self,
        rows: torch.Tensor,
        rows_cpu: np.ndarray,
        committed_lens_cpu: list[int],
        want_logprobs: bool,
        on_accepted: Callable[[SpecStepOutput], None] | None = None,
    ) -> SpecStepOutput:
        """One iteration for the requests on `rows` ([bs] device, rows_cpu its host copy);
        committed_lens_cpu: their committed lengths on the host for backends that read them
        (placeholders otherwise). on_accepted(step) runs once acceptance is queued, before the
        draft extend (the caller starts copying the results there). The rows' `RowState` has
        advanced once the extend has run. The step returned may view stage buffers that the
        next iteration's propose stage overwrites: it holds until then, in stream order."""
        variant = self.accept_variant(rows_cpu, want_logprobs)
        return self.iterate(rows, committed_lens_cpu, variant, want_logprobs, on_accepted)

    def iterate(
        self,
        rows: torch.Tensor,
        committed_lens_cpu: list[int],
        variant: str | None,
        want_logprobs: bool = False,
        on_accepted: Callable[[SpecStepOutput], None] | None = None,
    ) -> SpecStepOutput:
        """`decode` with the accept variant given (None: greedy, inside the propose stage)."""
        propose = self.propose_stages["greedy" if variant is None else "accept"]
        proposed = propose(ProposeInputs(rows), committed_lens_cpu)
        committed_lens = proposed.committed_lens
        if variant is None:  # accepted inside the propose stage
            accept_lens = proposed.greedy_accept_lens
            if self.topk > 1:
                result = VerifyResult(
                    proposed.greedy_predict, proposed.greedy_accept_index, accept_lens
                )
                self.compact(result, rows, committed_lens)
            step = SpecStepOutput(proposed.greedy_tokens, accept_lens, None)
            features = proposed.greedy_features  # [bs*(S+1), H_f]
        else:  # a `Proposal` is the accept stage's `AcceptInputs`
            accepted = self.accept_stages[variant](proposed, committed_lens_cpu)
            logprobs = accepted.logprobs if want_logprobs else None
            step = SpecStepOutput(accepted.tokens, accepted.accept_lens, logprobs)
            features = accepted.features
        if on_accepted is not None:
            on_accepted(step)
        extend = ExtendInputs(
            proposed.rows, committed_lens, step.accept_lens, step.tokens, features
        )
        self.extend_stage(extend, committed_lens_cpu)
        return step

    def accept_variant(self, rows_cpu: np.ndarray, want_logprobs: bool) -> str | None:
        """The accept stage a batch runs (host only): None when every row is plain greedy and
        no logprobs are wanted (the propose stage has accepted already), else the cheapest
        variant whose fixed stages cover every row's (`ACCEPT_FLAGS`)."""
        penalty, sampling, top_k, top_p, _ = self.sampling.stage_flags(rows_cpu)
        if not (penalty or sampling or want_logprobs):
            return None
        if penalty:
            return "penalize"
        return "filter" if top_k or top_p else "sample"

    def _accept(
        self,
        flags: tuple[bool, ...],
        bs: int,
        inputs: AcceptInputs,
        committed_lens_cpu: list[int],
    ) -> Accepted:
        """An accept stage: acceptance with the sampling stages `flags`, the accepted path's
        KV compacted, and the extend stage's inputs (tokens, accept lengths, features)."""
        # A graph's static inputs come per request ([bs, ND, ...]), a direct call's as the
        # propose stage made them: node rows flat ([bs*ND, ...]) where the tree keeps them so.
        nodes = bs * self.num_draft_tokens
        tree = inputs.tree(self.shape)
        logits, features = inputs.logits.reshape(nodes, -1), inputs.features.reshape(nodes, -1)
        rows = inputs.rows
        result, step, path_features = accept_and_read(
            self.sampling, tree, logits, features, rows, flags, self.accept_greedy
        )
        self.compact(result, rows, inputs.committed_lens)
        return Accepted(step.accept_lens, step.tokens, path_features, step.logprobs)
