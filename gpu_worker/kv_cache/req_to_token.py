"""`ReqToTokenPool`: per request row, the KV slot of every position of its sequence."""

from __future__ import annotations

import numpy as np
import torch


class ReqToTokenPool:
    """int32 table `req_to_token[num_rows + 1, max_context_len]`; row 0 is a reserved dummy.

    Request rows 1..num_rows are handed out by the scheduler. `req_to_token[row, pos]` is the
    KV slot holding position `pos` of the request on `row`. Entries not yet written are 0 (the
    dummy slot), so a stray read lands on harmless memory.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [num_rows + 1, max_context_len]
        self.req_to_token = torch.zeros(
            (num_rows + 1, max_context_len), dtype=torch.int32, device=self.device
        )

    def write(
        self,
        rows: torch.Tensor,
        start_positions: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
    ) -> None:
        """Record `slots` for positions `start_positions[i] ..` of row `rows[i]`.

        rows, start_positions, lens: [n] int on the pool's device; slots: [sum(lens)]
        concatenated request by request. Mutates `req_to_token` in place (one scatter).
        """
        num_slots = slots.shape[0]
        if num_slots == 0:
            return
        slot_rows = torch.repeat_interleave(rows.long(), lens, output_size=num_slots)
        starts = torch.repeat_interleave(start_positions.long(), lens, output_size=num_slots)
        # offset of each slot inside its own request: global index - first index of its request
        first = torch.cumsum(lens, 0) - lens  # [n]
        offsets = torch.arange(num_slots, device=slots.device) - torch.repeat_interleave(
            first, lens, output_size=num_slots
        )
        self.req_to_token[slot_rows, starts + offsets] = slots.to(torch.int32)

    def assign(self, flat_index: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token.view(-1)[flat_index[i]] = slots[i] for [n] device tensors (int64
        indices row * max_context_len + position, int32 slots): one kernel, the caller having
        expanded each request's range (`flat_index`)."""
        self.req_to_token.view(-1).index_copy_(0, flat_index, slots)

    def flat_index(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The flat indices of req_to_token[rows[i], positions[i]] (host arrays) for `assign`."""
        return rows * self.max_context_len + positions

    def slots_of(self, row: int, seq_len: int) -> torch.Tensor:
        """The KV slots of positions 0..seq_len of one row: [seq_len] int32 (a view)."""
        return self.req_to_token[row, :seq_len]
