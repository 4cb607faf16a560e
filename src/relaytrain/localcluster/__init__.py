"""A real multi-node Slurm cluster on this machine, for trying launches and tests (docs/local-cluster.md)."""
