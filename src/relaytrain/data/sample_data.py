"""The proof that each step of a run's surviving lineage read the data an uninterrupted run reads there,
from the prepared data's files read again, not from the loader's counters.

Every step's sample record carries `tokens`, a digest of the token windows the rank read (data/
consumption.py `tokens_digest`), and every segment's `begin` line the loader's data fingerprint (seed,
shuffle, mixture weights, seq_len, global batch, each source's path and manifest digest, world size).

**The expected data.** The run's data order is the one its lineage's first segment (the one that began
at step 0) declares. For every step s of the lineage and every data-parallel rank r of D, the check
computes global samples `[(s-1)G + rG/D, (s-1)G + (r+1)G/D)` itself: the sampler's published maps
(data/sampler.py: the mixture, each source's seeded permutation per epoch) from the fingerprint's
settings, and the windows read here from each source's shard files (memory-mapped, their sizes from the
files), then hashed; the training loader, its state and its reading code are not used. A digest that
differs names the step, the rank and what the rank read instead, where one of the nearby candidates
matches (the step before or after, another rank's share, the segment's own changed settings).

**Changes.** A segment whose order-deciding settings differ from its predecessor's in the lineage (a
resume with another seed, shuffle, weights, seq_len, global batch or sources) is a violation unless
`allow_change`: then the change is reported and that segment's steps are checked against its own
settings, at the same global sample index (the loader continues there). A change of world size or data-
parallel size is a resize: the global order does not depend on it, so it is only reported.

Cost: every token the lineage trained on is read once more (memory-mapped reads at disk speed); the
check reads nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.data.consumption import tokens_digest
from relaytrain.data.sample_check import Segment, lineage, read_segments
from relaytrain.data.sampler import Mixture, WindowOrder
from relaytrain.data.shards import manifest_digest
from relaytrain.job.rundir import RunDir

ORDER_KEYS = ("seed", "shuffle", "weights", "seq_len", "global_batch_size", "sources")


class SourceFiles:
    """One prepared directory's training split, read from its shard files alone (their sizes from the
    files, not from meta.json's counts)."""

    def __init__(self, path: Path) -> None:
        meta = json.loads((path / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        files = [path / shard["file"] for shard in meta["splits"]["train"]["shards"]]
        self.arrays = [np.memmap(f, dtype=dtype, mode="r") for f in files if f.stat().st_size]
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays])]).astype(np.int64)

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        pieces, at, end = [], start, start + length
        while at < end:
            shard = int(np.searchsorted(self.starts, at, side="right")) - 1
            offset = at - int(self.starts[shard])
            piece = self.arrays[shard][offset : offset + end - at]
            pieces.append(np.asarray(piece, dtype=np.int64))
            at += len(piece)
        return np.concatenate(pieces)


class ExpectedData:
    """The digest of any slice of the global sample sequence that one data fingerprint defines."""

    def __init__(self, settings: dict[str, Any], files: dict[str, SourceFiles]) -> None:
        self.seq_len = int(settings["seq_len"])
        self.sources = [files[s["path"]] for s in settings["sources"]]
        self.mixture = Mixture(list(settings["weights"]))
        seed = int(settings["seed"]) % (1 << 64)
        self.orders = [
            WindowOrder((src.tokens - 1) // self.seq_len, seed, i, bool(settings["shuffle"]))
            for i, src in enumerate(self.sources)
        ]

    def digest(self, first: int, count: int) -> str:
        source, local = self.mixture.assign(np.arange(first, first + count, dtype=np.int64))
        windows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for i, (s, j) in enumerate(zip(source.tolist(), local.tolist(), strict=True)):
            window = int(self.orders[s].windows(np.asarray([j]))[0])
            windows[i] = self.sources[s].read(window * self.seq_len, self.seq_len + 1)
        return tokens_digest(windows)


@dataclass
class DataReport:
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0  # step records whose tokens were compared
    unchecked: int = 0  # step records without a token digest (written before they existed)
    settings: dict[str, Any] | None = None

    def summary(self) -> str:
        if self.settings is None:
            return "; ".join(self.notes) or "no training step recorded"
        s = self.settings
        shuffle = "on" if s["shuffle"] else "off"
        head = (
            f"the tokens of {self.checked} step record(s) match the prepared data read again from its "
            f"files (seed {s['seed']}, shuffle {shuffle}, seq_len {s['seq_len']}, "
            f"{len(s['sources'])} source(s))"
        )
        if self.unchecked:
            head += f"; {self.unchecked} record(s) without a token digest not checked"
        return "; ".join([head, *self.notes])


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The order-deciding settings that differ, as `key a -> b` (sources by path and manifest)."""
    found = [key for key in ORDER_KEYS if before.get(key) != after.get(key)]
    return [
        key if key == "sources" else f"{key} {json.dumps(before.get(key))} -> {json.dumps(after.get(key))}"
        for key in found
    ]


def _open_sources(settings: list[dict[str, Any]], report: DataReport) -> dict[str, SourceFiles] | None:
    """Every source the settings name, read again; None (and a violation) when one is gone or changed."""
    files: dict[str, SourceFiles] = {}
    for source in (s for one in settings for s in one["sources"]):
        path = Path(source["path"])
        if source["path"] in files:
            continue
        if not (path / "meta.json").is_file():
            report.violations.append(f"the run's data {path} is gone: what it read cannot be read again")
            return None
        now = manifest_digest(path)
        if now != source["manifest"]:
            report.violations.append(
                f"the prepared data {path} changed since the run read it (manifest digest "
                f"{source['manifest']} then, {now} now): its steps are compared with the data as it is now"
            )
        files[source["path"]] = SourceFiles(path)
    return files


def _fingerprint(seg: Segment, report: DataReport) -> dict[str, Any] | None:
    """The segment's fingerprint (rank 0's); a violation when its ranks declare different data orders."""
    if not seg.data:
        return None
    first = seg.data[min(seg.data)]
    for rank, data in sorted(seg.data.items()):
        if changed(first, data):
            report.violations.append(
                f"{seg.name()}: rank {rank} declares other data settings than rank "
                f"{min(seg.data)} ({', '.join(changed(first, data))})"
            )
    return first


def _diagnose(
    expect: ExpectedData,
    own: ExpectedData | None,
    got: str,
    step: int,
    dp_rank: int,
    dp: int,
    global_batch: int,
) -> str:
    """What a rank read instead, where a nearby candidate matches."""
    share = global_batch // dp
    at = (step - 1) * global_batch + dp_rank * share
    candidates = [
        (at + global_batch, "step " + str(step + 1) + "'s (one batch ahead)"),
        (at - global_batch, "step " + str(step - 1) + "'s (one batch behind)"),
    ]
    candidates += [
        (at + (other - dp_rank) * share, f"dp rank {other}'s share")
        for other in range(dp)
        if other != dp_rank
    ]
    for first, what in candidates:
        if first >= 0 and expect.digest(first, share) == got:
            return f"it read {what}"
    if own is not None and own.digest(at, share) == got:
        return "it read the samples of its segment's changed data settings"
    return "it read none of the nearby steps' or ranks' samples"


def check_data(
    run: RunDir, global_batch: int, reached: int | None = None, allow_change: bool = False
) -> DataReport:
    """Every step of the run's surviving lineage whose tokens are not the expected data (see above)."""
    report = DataReport()
    if not run.sample_records.is_dir():
        report.notes.append("no sample records")
        return report
    segments, _ = read_segments(run)  # the records' own consistency is the samples check's
    parts, _ = lineage(segments, reached)
    if not parts or parts[0][0].begin != 0:
        report.notes.append("the lineage does not start at step 0 (see samples): data not checked")
        return report
    prints = [_fingerprint(seg, report) for seg, _, _ in parts]
    if prints[0] is None:
        report.notes.append("written before data fingerprints were recorded: the data read not checked")
        return report
    reference = report.settings = prints[0]
    known = [p for p in prints if p is not None]
    files = _open_sources(known, report)
    if files is None:
        return report
    expected = ExpectedData(reference, files)
    previous = reference
    for (seg, first_step, last_step), own in zip(parts, prints, strict=True):
        own = own or previous
        what = changed(previous, own)
        segment_expect, own_expect = expected, None
        if what and allow_change:
            report.notes.append(
                f"data settings changed at step {seg.begin} ({', '.join(what)}), allowed by "
                "--allow-data-change"
            )
            expected = segment_expect = ExpectedData(own, files)
        elif what:
            report.violations.append(
                f"step {seg.begin + 1} ({seg.name()}): the data settings changed since step {seg.begin}: "
                f"{', '.join(what)} (`relaytrain verify --allow-data-change` accepts a deliberate change)"
            )
            own_expect = ExpectedData(own, files)
        if own.get("world_size") != previous.get("world_size") and seg is not parts[0][0]:
            report.notes.append(
                f"resized at step {seg.begin}: world size {previous.get('world_size')} -> "
                f"{own.get('world_size')}, the global order kept"
            )
        _check_steps(seg, range(first_step, last_step + 1), segment_expect, own_expect, global_batch, report)
        previous = own
    return report


def _check_steps(
    seg: Segment,
    steps: range,
    expect: ExpectedData,
    own: ExpectedData | None,
    global_batch: int,
    report: DataReport,
) -> None:
    """Compare each record's token digest; one line for the segment's first differing step."""
    first_wrong: str | None = None
    wrong = 0
    for step in steps:
        for rank, record in sorted(seg.steps.get(step, {}).items()):
            got = record.get("tokens")
            if not isinstance(got, str):
                report.unchecked += 1
                continue
            dp, dp_rank = int(record["dp_size"]), int(record["dp_rank"])
            share = global_batch // dp
            at = (step - 1) * global_batch + dp_rank * share
            report.checked += 1
            if expect.digest(at, share) == got:
                continue
            wrong += 1
            if first_wrong is None:
                why = _diagnose(expect, own, got, step, dp_rank, dp, global_batch)
                who = f"step {step}, rank {rank} (dp rank {dp_rank}/{dp})"
                first_wrong = (
                    f"{who}: the tokens it read are not global samples [{at}, {at + share}) "
                    f"of the run's data ({why})"
                )
    if first_wrong is not None:
        count = f"; {wrong} record(s) of {seg.name()} differ" if wrong > 1 else ""
        report.violations.append(first_wrong + count)
