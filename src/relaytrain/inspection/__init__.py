"""Run inspection: `relaytrain status`, `logs`, `report` and `verify`, read from a run directory's own
files (Slurm is asked only about a job id)."""
