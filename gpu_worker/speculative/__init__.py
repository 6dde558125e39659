"""Speculative decoding (EAGLE, EAGLE-3, MTP) on the GPU worker, in fixed shapes.

Owns the decode iteration every draft algorithm shares (`iteration.SpeculativeWorker`: propose
-> accept -> compact -> draft extend, each stage a CUDA graph when it fits, handing the next
the dataclasses of `stage_buffers`) and its two draft algorithms (`eagle_worker.EagleWorker`:
S draft steps of topk branches from per-row draft state; `mtp_worker.MTPWorker`: one runner
per MTP layer, windows as tensors). Below them, plain
torch functions with no model calls, CPU and CUDA alike: the multi-step draft cache layout
(`draft_layout`: the one place that says where draft step i of branch j writes its KV), the
draft-loop bookkeeping and tree construction (`tree`: `DraftRecord`, `DraftTree`, the chain
fast path), the target's verify forward and reading a step's output (`target_verify`),
acceptance (`verify`: the longest path of drafts equal to the target's draws, into a
`VerifyResult`) and the
accepted-path compaction for topk > 1 (`compaction`: KV move lists and row reordering).
`gpu_worker.build` decides which worker runs from the configuration.
"""
