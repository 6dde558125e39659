"""The explicit forward context: `ForwardMode` and `ForwardBatch`, passed into `model.forward`,
and what a forward returns (`LogitsOutput`).

There is no global forward context: the runner gives the model a copy of the batch with its
backend's metadata filled in, and nobody mutates a batch it was given. Lengths are named as in
`docs/architecture.md`, "Names"; `*_cpu` fields are host copies that came with the plan.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()  # prefill (a chunk of) prompts
    DECODE = enum.auto()  # one token per request
    TARGET_VERIFY = enum.auto()  # a draft tree per request, attention through custom_mask
    DRAFT_EXTEND = enum.auto()  # draft model over accepted tokens
    DRAFT_DECODE = enum.auto()  # draft model, one step of the draft loop
    IDLE = enum.auto()  # no requests (keeps collective ranks in step)

    def samples_every_token(self) -> bool:
        """Modes that need logits for every token, not only each request's last one."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)


@dataclass
class SpecInput:
    """The minimal `ForwardBatch.spec_info` a draft model reads: the hidden state paired with
    each input token, [num_tokens, H_in] in the model dtype. H_in is the target's hidden size
    (EAGLE), the aux width num_aux * H (EAGLE-3 after a target forward) or the draft's own
    hidden size (a draft's pass-back between draft steps)."""

    hidden_states: torch.Tensor


@dataclass
class ForwardBatch:
    """Everything one model forward reads. Tensors live on the runner's device.

    custom_mask: None (causal), or a tree-local bool mask `[bs, q_len, width]` (True = may
        attend) over each request's LAST `width` keys, positions [seq_lens - width, seq_lens);
        every earlier key is visible. q_len is every request's extend length. Tree verify:
        width = q_len = ND (node k sees itself and its ancestors); multi-step draft decode:
        q_len = topk, width = topk * S (a row sees the drafts of its own branch so far).
    spec_info: speculative-decoding state for the modes that need it; draft models read its
        `hidden_states` attribute (any object that has one, e.g. `SpecInput`).
    logits_indices: [bs] token indices whose logits the runner computes, when they are not
        the default ones (see `sample_indices`): a fixed-shape draft extend runs S+1 tokens
        per request but wants the logits at each request's last accepted one.
    greedy_ids: the runner returns each sampled row's argmax token (`next_token_ids`) and no
        logits: a chain's draft steps and a plain greedy batch's verify read nothing else.
    draw_noise: with greedy_ids, each row's coupled proposal instead (`sampling.DrawNoise`):
        a chain's draft steps for sampled requests.
    attn_backend / attn_metadata: set by the runner on its own copy of the batch.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot of each new token
    rows: torch.Tensor  # [bs] int64
    # [bs] int64, keys attended: the KV length after the forward (committed_lens +
    # extend_seq_lens); in DRAFT_DECODE it also covers every branch's draft slots.
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor  # [bs] int64
    seq_lens_cpu: list[int]
    committed_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    custom_mask: torch.Tensor | None = None
    spec_info: object | None = None
    logits_indices: torch.Tensor | None = None
    greedy_ids: bool = False
    draw_noise: Any = None
    attn_backend: Any = None
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def sample_indices(self) -> torch.Tensor:
        """Token indices whose logits are wanted: `logits_indices` when set, else every token
        (modes that sample every token) or each request's last one."""
        if self.logits_indices is not None:
            return self.logits_indices
        if self.mode.samples_every_token():
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        return self.last_token_indices()

    def last_token_indices(self) -> torch.Tensor:
        """[bs] index of each request's last token in the flat token arrays."""
        return torch.cumsum(self.extend_seq_lens, 0) - 1


def build_forward_batch(
    mode: ForwardMode,
    input_ids: Sequence[Sequence[int]],
    committed_lens: Sequence[int],
    out_slots: Sequence[Sequence[int]],
    rows: Sequence[int],
    device: torch.device | str,
    positions: Sequence[Sequence[int]] | None = None,
    custom_mask: torch.Tensor | None = None,
) -> ForwardBatch:
    """A ForwardBatch from per-request host lists (see `HostBatch.from_requests`), moved to
    the device in one copy. custom_mask: a tree-local `[bs, extend_len, width]` mask."""
    from gpu_worker.step.host_batch import HostBatch

    host = HostBatch.from_requests(mode, input_ids, committed_lens, out_slots, rows, positions)
    mask = None if custom_mask is None else custom_mask.to(device, torch.bool)
    return host.to_device(torch.device(device), custom_mask=mask)


def make_batch(
    mode: ForwardMode,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    rows: torch.Tensor,
    seq_lens_cpu: list[int],
    extend_lens_cpu: list[int],
    custom_mask: torch.Tensor | None = None,
    spec_info: object | None = None,
    seq_lens: torch.Tensor | None = None,
    extend_seq_lens: torch.Tensor | None = None,
    logits_indices: torch.Tensor | None = None,
    greedy_ids: bool = False,
    draw_noise: object | None = None,
) -> ForwardBatch:
    """The one ForwardBatch constructor: device tensors, plus the lengths on the host (and on
    the device when the caller already has them there; otherwise they are copied)."""
    device = input_ids.device
    committed_lens_cpu = [n - e for n, e in zip(seq_lens_cpu, extend_lens_cpu, strict=True)]

    def on_device(values: list[int], tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is not None:
            return tensor
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return ForwardBatch(
        mode=mode,
        input_ids=input_ids.long(),
        positions=positions.long(),
        out_cache_loc=out_cache_loc.long(),
        rows=rows.long(),
        seq_lens=on_device(seq_lens_cpu, seq_lens),
        extend_seq_lens=on_device(extend_lens_cpu, extend_seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        committed_lens_cpu=committed_lens_cpu,
        extend_seq_lens_cpu=extend_lens_cpu,
        custom_mask=custom_mask,
        spec_info=spec_info,
        logits_indices=logits_indices,
        greedy_ids=greedy_ids,
        draw_noise=draw_noise,
    )


def decode_batch(
    backend: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
) -> ForwardBatch:
    """A DECODE batch whose every length is on the device already (a copy from the host
    cannot be captured): the host lengths are the real ones only for a backend that plans
    from them (`reads_host_lengths`, never captured), else the backend's fill value."""
    bs = rows.numel()
    if backend.reads_host_lengths:
        lens_cpu = seq_lens.tolist()
    else:
        lens_cpu = [backend.cuda_graph_seq_len_fill_value] * bs
    return make_batch(
        ForwardMode.DECODE,
        input_ids,
        positions,
        out_cache_loc,
        rows,
        lens_cpu,
        [1] * bs,
        seq_lens=seq_lens,
        extend_seq_lens=torch.ones_like(seq_lens),
    )


@dataclass
class LogitsOutput:
    """next_token_logits: [num_sampled, vocab] float32, one row per sampled position (each
    request's last token for EXTEND/DRAFT_EXTEND, every token for DECODE/TARGET_VERIFY/
    DRAFT_DECODE); an EAGLE-3 draft's vocab is its draft vocabulary (see `hot_token_id`).
    hidden_states: [num_tokens, hidden] for every token run: after the final norm for a target,
    the draft's pass-back hidden for a draft runner.
    aux_hidden_states: [num_tokens, len(aux_hidden_layers) * hidden] for a target runner with
    aux_hidden_layers (the residual stream entering those layers), else None.
    next_token_ids: [num_sampled] int64, the logits' argmax in the target's vocabulary, instead
    of the logits (None) for a batch with `greedy_ids`."""

    next_token_logits: torch.Tensor | None
    hidden_states: torch.Tensor | None  # None from a graph that keeps only the logits
    aux_hidden_states: torch.Tensor | None = None
    next_token_ids: torch.Tensor | None = None
