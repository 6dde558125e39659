"""Aerie's shared package: what every process needs and what clients import.

Owns the configuration dataclasses and their resolution (`config`, `resolve`), the endpoint
table (`endpoints`), every IPC message (`messages`) and its msgpack codec (`codec`), the ZMQ
transport (`transport`), process bootstrap and logging (`process`, `logging`), the launcher's
watchdog verdicts (`watchdog`), model directory facts (`model_info`), loading a model's Hugging
Face tokenizer (`hf_tokenizer`), the default model (`default_model`) and the public ZMQ client
(`client`). It imports nothing from the process packages.
"""
