"""The GPU worker: runs models on the device for the scheduler's ForwardPlans.

Owns model runners (one model + its own KV pool, req_to_token pool and attention backend
state each), the explicit `ForwardBatch` passed into every model forward, weight loading,
model architectures, layers, attention backends and KV storage, per-row sampling, CUDA graphs
(`cuda_graph` for the plain decode forward, `stage_graph` for the speculative stages) and
speculative decoding (`speculative`), and tensor parallelism (`parallel`: the rank's group and
collectives; the sharded layers are in `layers`). `build.build_models` makes all of it from the
configuration; `worker.GPUWorker` is the socket-free core that runs plans on it;
`warm_up` compiles the eager paths' kernels at start-up; `process.run_gpu_worker_process`
moves messages.
"""
