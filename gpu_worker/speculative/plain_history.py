"""`PlainHistory`: what the draft needs from the plain decode steps of adaptive speculation.

A speculative worker whose scheduler may run a decode step plainly (`scheduler_proc.adaptive`)
does not run the draft on those steps. The draft's KV then misses the plainly decoded
positions, and its state (the next step's first drafts) belongs to the position before them.
So each plain step records, per request row, the token it read at position p and the target
feature it computed there (what the draft pairs at p: `SpeculativeWorker.target_features`),
in a ring of WIDTH positions; two small scatters inside the step's graph.

Before the first iteration after plain steps, `catch_up` runs the draft over the last of those
positions (up to WIDTH) exactly as after a prefill chunk (`draft_prefill`: the chunk is the
recorded tokens, the tail the row's newest token), which writes the draft's KV there and
leaves its state at the newest token. Positions further back than WIDTH keep stale draft KV:
that costs acceptance, never exactness. The catch-up reads the rows' committed lengths on the
host (one synchronisation) and runs eagerly: it happens once per switch back to speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.forward_batch import ForwardMode, make_batch
from gpu_worker.model_runner import LogitsOutput

if TYPE_CHECKING:
    from gpu_worker.speculative.iteration import SpeculativeWorker

WIDTH = 64  # plain positions remembered per row (135M EAGLE-3: 221 KB a row)


class PlainHistory:
    def __init__(self, spec: SpeculativeWorker, num_rows: int, width: int = WIDTH) -> None:
        target = spec.target
        self.spec, self.width = spec, width
        self.tokens = torch.zeros(num_rows, width, dtype=torch.int64, device=target.device)
        self.features = torch.zeros(num_rows, width, spec.feature_width(), dtype=target.dtype,
                                    device=target.device)  # fmt: skip
        self.gaps = np.zeros(num_rows, dtype=np.int64)  # plain steps since the draft last ran

    def record(self, rows: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               out: LogitsOutput) -> None:  # fmt: skip
        """Inside a plain decode step: rows [bs] read input_ids at positions (the target's
        forward gave `out`)."""
        ring = positions % self.width
        self.tokens[rows, ring] = input_ids
        self.features[rows, ring] = self.spec.target_features(out)

    def on_plain_step(self, rows: np.ndarray) -> None:
        self.gaps[rows] += 1

    def on_draft_ran(self, rows: np.ndarray) -> None:
        """The draft ran on these rows' newest positions (a prefill, a new request)."""
        self.gaps[rows] = 0

    def catch_up(self, rows: np.ndarray) -> int:
        """Before an iteration over `rows` (host int64): the draft over the plainly decoded
        positions of those that have any. Returns how many rows it caught up."""
        stale = rows[self.gaps[rows] > 0]
        if not len(stale):
            return 0
        gaps = np.minimum(self.gaps[stale], self.width)
        self.gaps[stale] = 0
        spec = self.spec
        device = spec.target.device
        dev_rows = torch.from_numpy(stale).to(device)
        prefix = spec.state.prefix_lens[dev_rows].cpu().numpy()  # the one synchronisation
        positions = np.concatenate([np.arange(p - g, p) for p, g in zip(prefix, gaps, strict=True)])
        which = np.repeat(np.arange(len(stale)), gaps)
        dev_positions = torch.from_numpy(positions).to(device)
        token_rows = dev_rows[torch.from_numpy(which).to(device)]
        ring = dev_positions % self.width
        slots = spec.target.req_to_token_pool.req_to_token[token_rows, dev_positions]
        batch = make_batch(ForwardMode.EXTEND, self.tokens[token_rows, ring], dev_positions, slots,
                           dev_rows, prefix.tolist(), gaps.tolist())  # fmt: skip
        features = self.features[token_rows, ring]
        out = LogitsOutput(next_token_logits=None, hidden_states=features,
                           aux_hidden_states=features)  # fmt: skip
        spec.draft_prefill(batch, out, spec.state.tokens[dev_rows])
        return len(stale)
