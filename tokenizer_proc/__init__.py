"""The tokenizer process: the front door of the engine.

It owns the HTTP API (native and OpenAI), the ZMQ frontend `aerie.client` speaks, validation,
tokenization, rid assignment and the per-rid state that collects `TextDeltas` until a request
finishes. Entry point: `tokenizer_proc.process.run_tokenizer_process`.
"""
