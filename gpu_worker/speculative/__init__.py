"""Speculative decoding (EAGLE, EAGLE-3, MTP) on the GPU worker, in fixed shapes.

`iteration.SpeculativeWorker` is the iteration every algorithm shares, `eagle_worker` and
`mtp_worker` the algorithms; the other modules are pure torch functions (draft layout, trees,
verify and acceptance, compaction). `gpu_worker.build` picks the worker from the configuration.
"""
