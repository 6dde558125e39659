"""The frontend process (one or several, `--tokenizer-worker-num`): the front door of the engine.

It owns the HTTP API (native and OpenAI), the ZMQ frontend `aerie.client` speaks (the first
frontend only), validation, tokenization, rid assignment, routing to a replica, and the
per-rid state that turns the scheduler's `StepOutputs` into text (`detokenize`, stop strings
held back and trimmed by `stop_strings`) until a request finishes. Entry point:
`tokenizer_proc.process.run_tokenizer_process`.
"""
