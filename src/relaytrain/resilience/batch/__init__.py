"""The batch job's program (``python -m relaytrain.resilience.batch.driver``): the driver and its job
steps, the end-of-step decision, crash classes, restarts in place, spare and bad nodes, alerts."""
