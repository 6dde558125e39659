"""Training drafts for speculative decoding from the target itself (`python3 -m training`).

The offline pipeline from a target checkpoint to a draft the server loads: prompts, the
target's own responses, the recipes' training loop and export, and the offline accept
estimate, handing token files (`tokens`) on (`docs/speculation.md`, "Trained drafts").
Nothing here is imported by the server.
"""
