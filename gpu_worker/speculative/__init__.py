"""Pure EAGLE speculative-decoding functions: plain torch, CPU and CUDA alike, no model calls.

Owns the multi-step draft cache layout (`draft_layout`: the one place that says where draft
step i of branch j writes its KV), the draft-loop bookkeeping and tree construction (`tree`:
`DraftRecord`, `DraftTree`), target verification (`verify`: greedy and exact speculative
sampling into a `VerifyResult`), and the accepted-path compaction for topk > 1
(`compaction`: KV move lists and row reordering). The worker that runs models calls these.
"""
