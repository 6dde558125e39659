"""A step's batch on its way to the device, and the plain decode step.

`plan_arrays` reads a `ForwardPlan`'s columns, `host_batch` packs them for one upload,
`forward_batch` is the `ForwardBatch` every model forward takes, `row_state` what the device
keeps per request row between steps, and `decode_step` the plain decode step as one stage.
Plans are assembled in `aerie/plans.py`.
"""
