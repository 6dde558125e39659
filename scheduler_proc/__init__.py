"""The scheduler process (CPU only; never imports torch or CUDA).

Owns admission, batching and finishing: the request state machine (`request`), logical KV
allocation of request rows and pages (`kv_allocator`), the per-step decisions (`policy`),
turning a batch into a `ForwardPlan` (`plan`), finish checks (`stop`), the socket-free core
(`scheduler.Scheduler`) and the process loop that moves its messages (`process`).
"""
