"""Train and validation batches for the trainer, sharded over data-parallel ranks.

A sample is ``seq_len + 1`` consecutive tokens starting at a multiple of ``seq_len`` in a split's
token stream (inputs ``[:-1]``, targets ``[1:]``), so input windows never overlap. The training state is
the number of global samples consumed: for each optimizer step with global batch ``G`` over ``D`` ranks,
rank ``r`` reads global samples ``[consumed + r*G/D, consumed + (r+1)*G/D)`` and then everyone adds ``G``.
The global sequence therefore does not depend on ``D``, and a run may resume on a different layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaytrain.config.schema import DataConfig
from relaytrain.data.consumption import (
    CHAIN_START,
    CHAIN_UNKNOWN,
    Consumed,
    SampleRecorder,
    chain_next,
    range_digest,
    tokens_digest,
)
from relaytrain.data.sampler import Mixture, WindowOrder
from relaytrain.data.shards import PreparedDataset, TokenStream, manifest_digest
from relaytrain.data.sources import resolve_sources
from relaytrain.data.tokenizer import build_tokenizer
from relaytrain.errors import UserError

log = logging.getLogger("relaytrain.data")


def _seed64(seed: int) -> int:
    return int(seed) % (1 << 64)


def _num_windows(num_tokens: int, seq_len: int) -> int:
    return max(0, (num_tokens - 1) // seq_len)


def _read_windows(streams: list[TokenStream], source: np.ndarray, starts: np.ndarray, seq_len: int):
    """The samples' token windows, ``[count, seq_len + 1]`` int64."""
    out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
    for i, (s, start) in enumerate(zip(source.tolist(), starts.tolist(), strict=True)):
        out[i] = streams[s].read(start, seq_len + 1)
    return out


def _split(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[:, :-1]`` and targets ``[:, 1:]`` of token windows."""
    # numpy's strided copy; torch's .contiguous() on CPU is several times slower for this shape.
    return torch.from_numpy(np.ascontiguousarray(windows[:, :-1])), torch.from_numpy(
        np.ascontiguousarray(windows[:, 1:])
    )


def _read_samples(streams: list[TokenStream], source: np.ndarray, starts: np.ndarray, seq_len: int):
    return _split(_read_windows(streams, source, starts, seq_len))


class TrainLoader:
    """This rank's share of each optimizer step's global batch, from a seeded, resumable sample order.

    The share is given, not derived: `local_batch_size` sequences for data-parallel rank `dp_rank` of
    `dp_size`, as the layout's ParallelDims split the global batch (`local_batch_size * dp_size`).
    """

    def __init__(
        self,
        datasets: list[PreparedDataset],
        weights: list[float],
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        tokenizer=None,
        recorder: SampleRecorder | None = None,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.datasets, self.seq_len, self.shuffle = datasets, seq_len, shuffle
        self.local_batch_size, self.dp_rank, self.dp_size = local_batch_size, dp_rank, dp_size
        self.global_batch_size = local_batch_size * dp_size
        self.tokenizer, self.recorder = tokenizer, recorder
        self._streams = [d.split("train") for d in datasets]
        self._windows = []
        for d, stream in zip(datasets, self._streams, strict=True):
            n = _num_windows(stream.num_tokens, seq_len)
            if n == 0:
                raise UserError(
                    f"{d.path} has {stream.num_tokens} training tokens, fewer than train.seq_len+1="
                    f"{seq_len + 1}; use more data or a shorter train.seq_len"
                )
            self._windows.append(n)
        self.weights = list(weights)
        self.mixture = Mixture(self.weights)
        self.num_tokens = sum(s.num_tokens for s in self._streams)
        self._manifests = [manifest_digest(d.path) for d in datasets]
        self.samples_consumed = 0
        self.sample_chain = CHAIN_START  # over every step's global range so far (data/consumption.py)
        self._set_seed(seed)

    def _set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self._orders = [WindowOrder(n, _seed64(seed), i, self.shuffle) for i, n in enumerate(self._windows)]

    @property
    def samples_per_epoch(self) -> list[int]:
        """Windows in each source's training split (one epoch of that source)."""
        return list(self._windows)

    def global_samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of global samples ``[start, start + count)``."""
        return _split(self.token_windows(start, count))

    def token_windows(self, start: int, count: int) -> np.ndarray:
        """The token windows (``[count, seq_len + 1]``) of global samples ``[start, start + count)``."""
        source, local = self.mixture.assign(np.arange(start, start + count, dtype=np.int64))
        starts = np.empty_like(local)
        for s, order in enumerate(self._orders):
            where = source == s
            starts[where] = order.windows(local[where]) * self.seq_len
        return _read_windows(self._streams, source, starts, self.seq_len)

    def data_fingerprint(self) -> dict[str, Any]:
        """What decides the global sample sequence: the sample record's `begin` lines carry it."""
        sources = [
            {"path": str(d.path), "manifest": m} for d, m in zip(self.datasets, self._manifests, strict=True)
        ]
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "weights": self.weights,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "sources": sources,
        }

    def next_batch(self, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``[G/D, seq_len]`` inputs and targets for one optimizer step; advances by ``G``.

        `step`: the optimizer step the batch is for; the recorder, when the loader has one, writes it
        with the slice read (the trainer's sample record, data/consumption.py)."""
        first = self.samples_consumed + self.dp_rank * self.local_batch_size
        count = self.local_batch_size
        windows = self.token_windows(first, count)
        chain = chain_next(self.sample_chain, self.samples_consumed, self.global_batch_size)
        if self.recorder is not None and step is not None:
            tokens = tokens_digest(windows)  # what this rank read, as it will be given to the model
            consumed = Consumed(first, count, range_digest(first, count), self.sample_chain, chain, tokens)
            self.recorder.record(step, consumed, self.data_fingerprint())
        self.samples_consumed += self.global_batch_size
        self.sample_chain = chain
        return _split(windows)

    def _fingerprint(self) -> list[dict[str, Any]]:
        return [
            {"path": str(d.path), "tokenizer": d.tokenizer_name, "tokens": s.num_tokens}
            for d, s in zip(self.datasets, self._streams, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.samples_consumed,
            "sample_chain": self.sample_chain,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "weights": self.weights,
            "shuffle": self.shuffle,
            "sources": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved global sequence: its sample count and seed win over the config's seed."""
        self.samples_consumed = int(state["samples_consumed"])
        self.sample_chain = str(state.get("sample_chain", CHAIN_UNKNOWN))  # older checkpoints lack it
        if int(state["seed"]) != self.seed:
            self._set_seed(int(state["seed"]))
        changed = [
            k for k in ("seq_len", "weights", "shuffle") if state.get(k, getattr(self, k)) != getattr(self, k)
        ]
        if "sources" in state and state["sources"] != self._fingerprint():
            changed.append("sources")
        if changed:
            log.warning(
                "data %s changed since the checkpoint; continuing at global sample %d of the new order",
                ", ".join(changed),
                self.samples_consumed,
            )


class ValLoader:
    """Fixed validation batches: the same ones at every evaluation, rank-sharded, never shuffled."""

    def __init__(
        self, datasets: list[PreparedDataset], weights: list[float], seq_len: int, dp_rank: int, dp_size: int
    ) -> None:
        self.seq_len, self.dp_rank, self.dp_size = seq_len, dp_rank, dp_size
        self.mixture = Mixture(weights)
        self._streams, self._first, self._windows = [], [], []
        for d in datasets:
            stream = d.split("val")
            n = _num_windows(stream.num_tokens, seq_len)
            first = 0
            if n == 0:
                stream = d.split("train")
                train_windows = _num_windows(stream.num_tokens, seq_len)
                if train_windows == 0:
                    raise UserError(
                        f"{d.path} has {stream.num_tokens} training tokens, fewer than train.seq_len+1="
                        f"{seq_len + 1}; use more data or a shorter train.seq_len"
                    )
                n = max(1, train_windows // 100)
                first = train_windows - n
                log.warning(
                    "%s has no validation split long enough for seq_len %d; validating on the "
                    "last %d training windows instead (they are also trained on)",
                    d.path,
                    seq_len,
                    n,
                )
            self._streams.append(stream)
            self._first.append(first)
            self._windows.append(n)
        self.num_tokens = sum(n * seq_len for n in self._windows)

    def batches(self, num_batches: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``num_batches`` batches of ``[batch_size, seq_len]`` for this rank (``batch_size`` per rank)."""
        for b in range(num_batches):
            start = (b * self.dp_size + self.dp_rank) * batch_size
            source, local = self.mixture.assign(np.arange(start, start + batch_size, dtype=np.int64))
            windows = np.asarray(self._first)[source] + local % np.asarray(self._windows)[source]
            yield _read_samples(self._streams, source, windows * self.seq_len, self.seq_len)


def _open(
    data: DataConfig, vocab_size: int, runs_dir: str | Path
) -> tuple[list[PreparedDataset], list[float]]:
    paths: list[Path] = resolve_sources(data, vocab_size=vocab_size, runs_dir=runs_dir)
    weights = list(data.weights) if data.weights else [1.0] * len(paths)
    return [PreparedDataset(p) for p in paths], weights


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device. To CUDA through pinned memory without blocking: a copy from
    pageable memory waits for the device, once a step."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def build_train_loader(
    data: DataConfig,
    dp_rank: int,
    dp_size: int,
    local_batch_size: int,
    *,
    seq_len: int,
    seed: int,
    vocab_size: int,
    runs_dir: str | Path,
    recorder: SampleRecorder | None = None,
) -> TrainLoader:
    """`dp_size`, `local_batch_size`: ParallelDims.dp and .local_batch_size of the validated layout.

    `seq_len`, `seed`, `vocab_size`, `runs_dir`: train.seq_len, run.seed, model.vocab_size and run.dir.
    `recorder`: where each step's consumed slice is recorded (the trainer's sample record).
    """
    datasets, weights = _open(data, vocab_size, runs_dir)
    tokenizer = build_tokenizer(data.tokenizer)
    return TrainLoader(
        datasets,
        weights,
        seq_len,
        local_batch_size,
        dp_rank,
        dp_size,
        seed=seed,
        shuffle=data.shuffle,
        tokenizer=tokenizer,
        recorder=recorder,
    )


def build_val_loader(
    data: DataConfig, dp_rank: int, dp_size: int, *, seq_len: int, vocab_size: int, runs_dir: str | Path
) -> ValLoader:
    datasets, weights = _open(data, vocab_size, runs_dir)
    return ValLoader(datasets, weights, seq_len, dp_rank, dp_size)
