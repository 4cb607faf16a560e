"""Data: tokenizers, prepared token shards, the resumable global sampler, and the bundled corpus.

Names are imported lazily so that tokenizing worker processes never import torch.
"""

from __future__ import annotations

from relaytrain.lazy import lazy_getattr

_EXPORTS = {
    "build_tokenizer": "relaytrain.data.tokenizer",
    "tokenizer_name": "relaytrain.data.tokenizer",
    "ByteTokenizer": "relaytrain.data.tokenizer",
    "HFTokenizer": "relaytrain.data.tokenizer",
    "prepare_dataset": "relaytrain.data.prepare",
    "PreparedDataset": "relaytrain.data.shards",
    "resolve_sources": "relaytrain.data.sources",
    "SampleRecorder": "relaytrain.data.consumption",
    "TrainLoader": "relaytrain.data.loader",
    "ValLoader": "relaytrain.data.loader",
    "build_train_loader": "relaytrain.data.loader",
    "build_val_loader": "relaytrain.data.loader",
    "to_device": "relaytrain.data.loader",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
