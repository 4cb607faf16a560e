"""relaytrain: train Llama-style language models on a laptop, one node or a SLURM cluster."""

__version__ = "0.1.0"

