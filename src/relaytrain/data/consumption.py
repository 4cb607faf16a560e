"""What each rank's train loader consumed, step by step: the records `relaytrain verify` proves from.

Every rank appends one line per step to its own file (`RunDir.sample_record(rank)`): the step, its data-
parallel rank and size, the first global sample index and the count it read, an xxh3 digest of the index
list it read, an xxh3 digest of the token ids it read (`tokens_digest`, of the batch on the host before it
is moved to the device: what the model was given, not what the loader's counters say), and the sample
chain after the step. Each rank writes what its own loader read (rank 0
could compute every slice, but then a rank that resumed at another position would go unseen), with one
`os.write` (the file opened and closed around it: nothing to close, nothing buffered) and no collective:
microseconds a step (bench/sample_record.py measures it).

The sample chain is a hash over the global ranges of every step the loader's state has consumed since
sample 0 (`chain_next`). It is part of the data position a checkpoint or snapshot keeps, so a resumed
loader continues the chain of the state it was restored from, and a replayed step continues it from the
restored value. A rank writes a `begin` line (the step and chain it starts from, and the loader's data
fingerprint: seed, shuffle, mixture weights, seq_len, global batch, each source's path and manifest
digest, and the world size) when it starts and after its state was reloaded (a NaN rollback): `verify`
follows the surviving lineage backwards through these, and an attempt whose starting chain no recorded
step produced is a violation of its own.

An attempt is one start of the training processes; its id is chosen by rank 0 and shared at start (one
broadcast per start, none per step), so the lines of all ranks of one attempt can be grouped, whatever
the number of ranks of the attempts before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from relaytrain.job import jsonl
from relaytrain.job.rundir import RunDir

CHAIN_START = "start"  # the chain of a loader that has consumed nothing
CHAIN_UNKNOWN = "unknown"  # restored from a checkpoint written before the chain existed


def indices_digest(indices: np.ndarray) -> str:
    """xxh3_64 of the index list as little-endian int64: the same list gives the same digest anywhere."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(indices, dtype="<i8").tobytes())


def range_digest(first: int, count: int) -> str:
    """The digest of the contiguous index list ``[first, first + count)``."""
    return indices_digest(np.arange(first, first + count, dtype=np.int64))


def tokens_digest(windows: np.ndarray) -> str:
    """xxh3_64 of a step's token windows (``[count, seq_len + 1]``, each sample's inputs and its last
    target) as little-endian int64: `relaytrain verify` reads the same windows from the prepared files and
    hashes them the same way (data/sample_data.py)."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(windows, dtype="<i8").tobytes())


def chain_next(chain: str, first: int, count: int) -> str:
    """The chain after a step that consumed global samples ``[first, first + count)``."""
    return xxhash.xxh3_64_hexdigest(f"{chain}:{first}:{count}".encode())


@dataclass(frozen=True)
class Consumed:
    """One step of one rank's loader: its slice of the global batch and the chain around the step."""

    first: int  # the first global sample index this rank read
    count: int
    digest: str  # of the index list this rank read
    chain_before: str
    chain_after: str
    tokens: str = ""  # `tokens_digest` of the windows read ("": not taken)


class SampleRecorder:
    """Appends this rank's `Consumed` of each step to its sample record; `begin` lines when it starts and
    after its loader's state was reloaded (detected: the chain the step starts from is not the last one
    written)."""

    def __init__(
        self, run: RunDir, rank: int, attempt: str, dp_rank: int, dp_size: int, world_size: int | None = None
    ):
        self.rank, self.attempt, self.dp_rank, self.dp_size = rank, attempt, dp_rank, dp_size
        self.world_size = world_size
        self.path = run.sample_record(rank)
        self._chain: str | None = None

    def record(self, step: int, consumed: Consumed, fingerprint: dict[str, Any] | None = None) -> None:
        """The step the trainer is about to take and what the loader just read for it; `fingerprint`: the
        loader's data settings (written on the `begin` line of a segment)."""
        base = {"attempt": self.attempt, "dp_rank": self.dp_rank, "dp_size": self.dp_size}
        if consumed.chain_before != self._chain:
            begin = {**base, "begin": step - 1, "chain": consumed.chain_before}
            if fingerprint is not None:
                begin["data"] = {**fingerprint, "world_size": self.world_size}
            jsonl.append(self.path, begin)
        line = {
            **base,
            "step": step,
            "first": consumed.first,
            "count": consumed.count,
            "digest": consumed.digest,
            "chain": consumed.chain_after,
        }
        if consumed.tokens:
            line["tokens"] = consumed.tokens
        jsonl.append(self.path, line)
        self._chain = consumed.chain_after


def record_files(run: RunDir) -> list[tuple[int, Path]]:
    """(rank, path) of every rank's sample record, rank order."""
    ranked = ((run.record_rank(path), path) for path in run.sample_records.glob("*"))
    return sorted((rank, path) for rank, path in ranked if rank >= 0)
