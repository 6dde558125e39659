"""The GPU worker: runs models on the device for the scheduler's ForwardPlans.

`build.build_models` makes the runners, drafts and sampling state from the configuration,
`worker.GPUWorker` is the socket-free core that runs plans on them, and
`process.run_gpu_worker_process` moves messages. Folders: `docs/architecture.md`.
"""
