"""Training drafts for speculative decoding from the target itself (`python3 -m training`).

Owns the offline pipeline that turns a target checkpoint into a draft the server loads:
`prompts` (ShareGPT prompts with the server's chat template, decontaminated against the
benchmarks), `generate` (the target's own responses, batched on Aerie's model runner), the
dense training forwards of the server's own draft modules (`dense`, `target`, `rows`), the
recipes (`eagle3`, `eagle`, `mtp` on `recipes`) with their export in the server's draft
formats and their loss (`soft_ce`: the soft cross-entropy, fused in Triton on a GPU), the loop
with checkpoints and resume (`train`), and the offline accept estimate walked like the verifier
(`estimate`). Token files (`tokens`) carry data between the stages.
Nothing here is imported by the server.
"""
