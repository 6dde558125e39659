"""Triton kernels for the decoder layers and the `triton` attention backend, the deterministic
mode's batch-invariant matmul (`batch_invariant`, which also holds the mode's switch), the norm
or SiLU step the few-row projection kernels fuse before them (`prologue`) and the tensor-parallel
all-reduce through peer memory (`peer_all_reduce`).

Each module exposes a kernel (`name`) next to the torch reference that defines its result
(`name_reference`); layers choose with `use_triton`. On CPU the kernels run in Triton's
interpreter, `TRITON_INTERPRET=1`, which must be set before triton is imported.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
