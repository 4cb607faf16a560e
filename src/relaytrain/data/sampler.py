"""Deterministic maps from a global sample index to (source, window): mixture and per-source order.

Both are pure functions of the index (plus seed and weights), so any rank can compute any slice of the
global sample sequence without replaying history; this is what makes the sampler state a single count.
"""

from __future__ import annotations

import math

import numpy as np


class Mixture:
    """Blend sources with fixed weights: global index -> (source id, index within that source).

    Samples are grouped in blocks of ``block`` indices. After ``k`` blocks, source ``s`` has received
    ``floor(k*B*w_s)`` samples, plus one for the sources with the largest remainders until the ``k*B``
    samples are accounted for, so its share is within one sample of ``w_s`` at every block boundary and
    exact in the long run. Inside a block the sources' samples are interleaved evenly.
    """

    def __init__(self, weights: list[float]) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if len(w) == 0 or not np.all(w > 0):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        self.weights = w / w.sum()
        # Every source needs >= 2 samples per block so cumulative counts never decrease (see docstring).
        self.block = max(1024, math.ceil(2.0 / float(self.weights.min())))
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _cumulative(self, k: int) -> np.ndarray:
        """Samples each source has received in the first ``k`` blocks."""
        ideal = (k * self.block) * self.weights
        counts = np.floor(ideal).astype(np.int64)
        missing = k * self.block - int(counts.sum())
        if missing > 0:
            order = np.lexsort((np.arange(len(ideal)), -(ideal - counts)))
            counts[order[:missing]] += 1
        return counts

    def _table(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """For block ``k``: each position's source and index within that source."""
        if k not in self._tables:
            start = self._cumulative(k)
            per_source = self._cumulative(k + 1) - start
            sources = np.repeat(np.arange(len(per_source)), per_source)
            ranks = np.concatenate([np.arange(c) for c in per_source])
            keys = (ranks + 0.5) / per_source[sources]
            order = np.lexsort((sources, keys))
            sources, ranks = sources[order], ranks[order]
            if len(self._tables) >= 8:
                self._tables.pop(next(iter(self._tables)))
            self._tables[k] = (sources, start[sources] + ranks)
        return self._tables[k]

    def assign(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index = np.asarray(index, dtype=np.int64)
        if len(self.weights) == 1:
            return np.zeros_like(index), index
        source, local = np.empty_like(index), np.empty_like(index)
        blocks = index // self.block
        for k in np.unique(blocks):
            where = blocks == k
            table_source, table_local = self._table(int(k))
            pos = index[where] - k * self.block
            source[where], local[where] = table_source[pos], table_local[pos]
        return source, local


class WindowOrder:
    """One source's sample order: index within the source -> window number.

    Epoch ``e`` visits all ``num_windows`` windows once, in a permutation seeded by (seed, source, e)
    when ``shuffle`` is on, and in file order otherwise; indices past the end wrap into later epochs.
    """

    def __init__(self, num_windows: int, seed: int, source: int, shuffle: bool) -> None:
        self.num_windows, self.seed, self.source, self.shuffle = num_windows, seed, source, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, self.source, epoch])
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def windows(self, local: np.ndarray) -> np.ndarray:
        local = np.asarray(local, dtype=np.int64)
        pos = local % self.num_windows
        if not self.shuffle:
            return pos
        epochs = local // self.num_windows
        out = np.empty_like(local)
        for e in np.unique(epochs):
            where = epochs == e
            out[where] = self._perm(int(e))[pos[where]]
        return out
