"""What the worker runs besides steps: the start-up warm-up (`warm_up`), the start-up cost
measurement adaptive speculation reads (`step_costs`), profiling (`step_profile`, with
`cupti_trace` for graph launches), and a rank group in spawned processes for the tests and
benchmarks of collectives (`ranks`).
"""
