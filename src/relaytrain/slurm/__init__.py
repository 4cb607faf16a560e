"""SLURM: sbatch script generation and submission, the SLURM -> torch environment mapping, job tools."""
