"""Physical KV storage of one model runner: the request-to-slot table and the per-layer K/V pool.

The scheduler owns logical allocation (which rows and slots are free); these classes only store.
Row 0 of `ReqToTokenPool` and slot 0 (page 0) of `KVPool` are reserved dummies that padded
batch rows point at.
"""

from gpu_worker.kv_cache.kv_pool import KVPool, kv_bytes_per_token
from gpu_worker.kv_cache.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "kv_bytes_per_token"]
