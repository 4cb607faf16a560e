"""``python -m relaytrain.resilience.step_end``: the end-of-step decision under its earlier name.

Batch scripts rendered before the batch driver ran the decision in-process call it after each job
step; it is ``relaytrain.resilience.batch.step_end`` now, and this name keeps working until 0.3.0."""
