"""The GPU worker: runs models on the device for the scheduler's ForwardPlans.

Owns model runners (`model_runner`: one model with its own KV pool, req_to_token pool and
attention backend state each), model architectures, layers, attention backends and KV storage
(`models`, `layers`, `attention`, `kv_cache`, `kernels`), weight loading (`weights`), per-row
sampling (`sampling`) and tensor parallelism (`parallel`). By folder:
    step/         a step's batch on its way to the device, and the plain decode step
    graphs/       CUDA graph capture and replay (decode, prefill, speculative stages)
    speculative/  the speculative iteration and its draft algorithms
    tooling/      warm-up, start-up cost measurement, profiling
`build.build_models` makes it all from the configuration; `worker.GPUWorker` is the
socket-free core that runs plans on it; `process.run_gpu_worker_process` moves messages.
"""
