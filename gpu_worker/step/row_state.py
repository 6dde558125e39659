"""`RowState`: what the worker keeps per request row on the device between steps.

`tokens[row]` (the newest token, no KV yet) and `committed_lens[row]`: written by sampling and
acceptance, read by the next decode step, so a decode plan carries neither (the overlap
schedule). Row 0, the dummy padded graph rows use, stays at token 0 and length 0.
"""

from __future__ import annotations

import torch


class RowState:
    def __init__(self, num_rows: int, device: torch.device) -> None:
        """num_rows: request rows including the dummy row 0."""
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.committed_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def decode_inputs(
        self, rows: torch.Tensor, req_to_token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A one-token decode step's inputs for rows [n]: (input_ids, positions, out_cache_loc,
        seq_lens), each [n] int64: the last token at the committed length, its slot, and the
        keys it attends (itself included)."""
        positions = self.committed_lens[rows]
        return self.tokens[rows], positions, req_to_token[rows, positions], positions + 1

    def commit_extend(
        self, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """After an extend: rows [n] have KV up to lengths [n]; where sampled [n] (a last
        chunk) the row's newest token is tokens [n]."""
        self.committed_lens[rows] = lengths
        self.tokens[rows] = torch.where(sampled, tokens, self.tokens[rows])

    def commit_decode(
        self, rows: torch.Tensor, advance: torch.Tensor | int, tokens: torch.Tensor
    ) -> None:
        """After a decode step: rows [n] committed `advance` ([n] or one int) more positions
        and emitted tokens [n] as their newest."""
        self.committed_lens[rows] += advance
        self.tokens[rows] = tokens

    def commit_accepted(
        self, rows: torch.Tensor, accept_lens: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """After a speculative iteration: rows [n] committed accept_lens [n] more positions and
        emitted tokens [n, S+1] (valid up to accept_lens), the last of them now the newest;
        padded rows wrote row 0, reset."""
        self.commit_decode(rows, accept_lens, tokens.gather(1, (accept_lens - 1)[:, None])[:, 0])
        self.reset_dummy()

    def reset_dummy(self) -> None:
        """Row 0 back to token 0 and length 0, after a step whose padded rows wrote it."""
        self.tokens[:1].zero_()  # (a slice: `[0] = 0` would copy from the host, not capturable)
        self.committed_lens[:1].zero_()
