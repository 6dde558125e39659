"""CUDA graphs: one mechanism, `stage_graph.StageGraph`, a function of static buffers (the
fields of its input dataclass) captured once per bucket and replayed.

`capture` (the capture loop and the batch-size buckets), `stage_graph` (the mechanism; the
decode step and every speculative stage are stages), `forward_graph` (a runner's forward as a
stage: plain decode batches, and short prefills bucketed by tokens).
"""
