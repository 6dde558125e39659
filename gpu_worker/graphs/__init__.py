"""CUDA graphs: capture once per batch bucket, replay on static buffers.

`stage_graph` (the decode step and the speculative stages), `prefill_graph` (short prefills,
bucketed by tokens) and `cuda_graph` (the bucket list and warm-up rule they share, and the
forward graphs of one runner).
"""
