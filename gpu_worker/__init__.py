"""The GPU worker: runs models on the device for the scheduler's ForwardPlans.

Owns model runners (one model + its own KV pool, req_to_token pool and attention backend
state each), the explicit `ForwardBatch` passed into every model forward, weight loading,
model architectures, layers, attention backends and KV storage, and per-row sampling.
`worker.GPUWorker` is the socket-free core; `process.run_gpu_worker_process` moves messages.
"""
