"""The tokenizer process: the front door of the engine.

It owns the HTTP API (native `/generate`, OpenAI-compatible `/v1/*`, health, server info and
Prometheus metrics), the external ZMQ frontend used by `aerie.client`, request validation,
tokenization, rid assignment and the per-rid state that collects `TextDeltas` from the
detokenizer until a request finishes. It sends `TokenizedRequest` / `AbortRequest` to the
scheduler and reports `DrainDone` to the launcher. The entry point is
`tokenizer_proc.process.run_tokenizer_process`.
"""
