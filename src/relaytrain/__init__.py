"""relaytrain: train Llama-style language models on a laptop, one node or a SLURM cluster."""

from __future__ import annotations

from relaytrain.version import __version__

__all__ = ["__version__", "load_model"]


def load_model(path):
    """The model of a checkpoint (step dir, run dir, or exported HF/torch dir), in eval mode on CPU.

    `relaytrain.load_model("runs/debug")(torch.tensor([[1, 2, 3]]))` returns logits [1, 3, vocab].
    """
    from relaytrain.checkpoint.sources import load_model as _load_model

    return _load_model(path)
