"""Attention backends: store the new tokens' K/V in a runner's KVPool and attend over each
request's KV through its req_to_token row. `base.AttentionBackend` is the interface,
`create_attention_backend` the registry lookup: "torch_native" (the reference, CPU default) and
"triton" (the CUDA default; CUDA-graph capable).
"""

from gpu_worker.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionLayer,
    RopeArgs,
    create_attention_backend,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayer",
    "RopeArgs",
    "create_attention_backend",
]
