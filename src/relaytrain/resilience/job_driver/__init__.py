"""``python -m relaytrain.resilience.job_driver``: the batch job's driver under its earlier name.

A batch script rendered before the driver moved to ``relaytrain.resilience.batch.driver`` runs this name
again when Slurm requeues its job (and, when it cannot import it, runs the step without a driver), so
the name keeps working until 0.3.0."""
