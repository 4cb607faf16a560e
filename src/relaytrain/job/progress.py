"""Where each rank is, published cheaply for the node's hang watcher: the progress board.

Every rank of a job step keeps one small memory-mapped file in a node-local folder
(``RELAYTRAIN_PROGRESS_DIR``, on the node's tmpfs, set by the task wrapper that starts the watcher):
its step, its phase (the start-up's launch, rendezvous, set-up, compilation and first step; data,
forward/backward, optimizer, evaluation, checkpoint save or load, snapshot, stop), when the phase began,
its progress marks inside the phase (``mark``: a layer's forward or backward, an evaluation batch, a
shard read or written, a graph compiled), the collectives relaytrain issued that it entered and left (and
the last one's name), how many it entered per step, and per phase the recent median of its length and
of its longest pause between two marks (what the hang monitor's limit is measured on). A write is a
``struct.pack_into`` into the mapping (no system call), so publishing every phase of every step costs
microseconds; marks closer together than ``MARK_GAP_S`` are counted but not written. The watcher
(``relaytrain.resilience.hangs.watch``) reads the files from another process, so a rank that is stopped,
in uninterruptible sleep or holding the GIL in a C call still shows where it stopped.

A record is written under a sequence lock: the sequence number is odd while a write is under way, and a
reader retries until it reads the same even number before and after.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import signal
import statistics
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

PROGRESS_DIR_ENV = "RELAYTRAIN_PROGRESS_DIR"
# The watcher asks a rank for its Python stacks with this signal (faulthandler.register in the trainer).
# SIGURG's default action is to ignore it, so a process that registered nothing (torchrun's agent, a
# program) is not harmed by it.
STACK_SIGNAL = signal.SIGURG
MAGIC = b"RTPB"
VERSION = 3
RECENT = 16  # phase lengths (and longest pauses) kept per phase for their medians
# A mark this soon after the last write is counted (its pause measured) but not written: a rank marking
# every layer of a fast step publishes at most 1 / MARK_GAP_S times a second, so marking costs nanoseconds.
MARK_GAP_S = 0.01


class Phase(enum.IntEnum):
    """What a rank is doing. The codes are the record's; the order within a step is
    ``detect.progress_key``'s (a phase after a step belongs to the step just finished)."""

    STARTUP = 0  # the rest of the start-up: the model's build, the loaders, the logs (set-up)
    DATA = 1
    FORWARD_BACKWARD = 2
    OPTIMIZER = 3
    EVALUATION = 4
    CHECKPOINT_SAVE = 5
    SNAPSHOT = 6
    CHECKPOINT_LOAD = 7
    STOP = 8  # the save after a stop was agreed, then the exit
    DONE = 9  # the run finished or the process is leaving
    AFTER_STEP = 10  # from the end of a step to the next (logging, the stop agreement after a save)
    # The start-up's own phases (issue 53), each with its own limit (hang_detect.phase_limit)
    LAUNCH = 11  # from the task wrapper's first instruction: the process start and the imports
    RENDEZVOUS = 12  # the process group's creation and the first health all-reduce
    COMPILE = 13  # a graph compiled (marked per graph); goes back to the phase it interrupted
    FIRST_STEP = 14  # the process's first step: its data, forward/backward (layers marked), optimizer

    @property
    def label(self) -> str:
        return PHASE_LABELS[self]


PHASE_LABELS = {
    Phase.STARTUP: "set-up",
    Phase.DATA: "data",
    Phase.FORWARD_BACKWARD: "forward/backward",
    Phase.OPTIMIZER: "optimizer",
    Phase.EVALUATION: "evaluation",
    Phase.CHECKPOINT_SAVE: "checkpoint save",
    Phase.SNAPSHOT: "snapshot",
    Phase.CHECKPOINT_LOAD: "checkpoint load",
    Phase.STOP: "stop",
    Phase.DONE: "done",
    Phase.AFTER_STEP: "after the step",
    Phase.LAUNCH: "launch",
    Phase.RENDEZVOUS: "rendezvous",
    Phase.COMPILE: "compilation",
    Phase.FIRST_STEP: "first step",
}
NAME_BYTES = 24
# magic, version, seq | rank, local_rank, pid | step, phase, phase_started, updated, budget |
# entered, left, name, expected name | step_collectives, last_step_collectives, usual_step_collectives |
# marks | medians | pauses
_HEAD = struct.Struct("<4sHxxQ")
_PHASES = tuple(Phase)  # in the record's order (iterating the enum on every write costs microseconds)
_BODY = struct.Struct(f"<iiiqBdddQQ{NAME_BYTES}s{NAME_BYTES}sIIIQ{len(Phase)}d{len(Phase)}d")
SIZE = _HEAD.size + _BODY.size
# The body in three parts: what a collective or a mark changes (from `updated` to `marks`) is written
# alone, since a call between two tensor operations runs with cold caches, where each field packed costs.
_PREFIX = struct.Struct("<iiiqBd")
_MOVE = struct.Struct(f"<ddQQ{NAME_BYTES}s{NAME_BYTES}sIIIQ")
_STATS = struct.Struct(f"<{2 * len(Phase)}d")
_MOVE_AT, _STATS_AT = _HEAD.size + _PREFIX.size, _HEAD.size + _PREFIX.size + _MOVE.size
assert _PREFIX.size + _MOVE.size + _STATS.size == _BODY.size


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's published position."""

    rank: int
    local_rank: int
    pid: int
    step: int  # the last finished step
    phase: Phase
    phase_started: float  # time.time() when the phase began
    updated: float  # time.time() of the last write
    budget_s: float  # the rank's own bound for this phase (a save's estimate); 0: none
    collectives_entered: int
    collectives_left: int
    collective: str  # the last collective entered ("" before the first)
    step_collectives: int  # entered since the last step finished
    last_step_collectives: int  # entered during the last finished step
    usual_step_collectives: int  # entered during most recent steps (0: not known yet)
    medians: dict[Phase, float]  # recent median length of each phase, seconds (absent: not measured)
    # the collective the rank entered at the same place in the step before (its n-th since that step
    # ended): "" when that step had fewer. Ranks that agree on it and differ in `collective` desynchronised.
    expected_collective: str = ""
    marks: int = 0  # progress marks published so far (a layer's forward, a shard written, ...)
    # the recent median of each phase's longest pause between two moves (entry, marks, collectives, end)
    pauses: dict[Phase, float] = field(default_factory=dict)

    @property
    def in_collective(self) -> bool:
        return self.collectives_entered > self.collectives_left

    def token(self) -> tuple[int, int, int, int, int]:
        """Changes whenever the rank moves: a new step or phase, a collective entered or left, a mark."""
        return (self.step, int(self.phase), self.collectives_entered, self.collectives_left, self.marks)


class ProgressBoard:
    """The writer: one rank's record. ``ProgressBoard.open_from_env`` gives a board that writes only when
    the job's task wrapper set ``RELAYTRAIN_PROGRESS_DIR`` (a run outside Slurm has no watcher)."""

    def __init__(self, directory: Path | None, rank: int, local_rank: int):
        self.rank, self.local_rank = rank, local_rank
        self._map: mmap.mmap | None = None
        self._pid = os.getpid()  # the rank's process (the task wrapper's exec keeps it); read once
        self._seq = self._step = 0
        self._phase = Phase.STARTUP
        self._phase_started = time.time()
        self._budget = self._phase_budget = 0.0
        self._entered = self._left = 0
        self._name = self._expected = b""
        self._names: list[bytes] = []  # entered since the last step ended, in order
        self._last_names: list[bytes] = []  # entered during the step before
        self._step_collectives = self._last_step_collectives = 0
        self._per_step: deque[int] = deque(maxlen=RECENT)
        self._usual = 0
        self._lengths: dict[Phase, deque[float]] = {p: deque(maxlen=RECENT) for p in Phase}
        self._medians: dict[Phase, float] = {}
        self._marks = 0
        self._moved = self._written = self._phase_started  # the last move; the last write
        self._longest = 0.0  # the longest pause between two moves in the phase under way
        self._pause_lengths: dict[Phase, deque[float]] = {p: deque(maxlen=RECENT) for p in Phase}
        self._pauses: dict[Phase, float] = {}
        self._stats = (0.0,) * (2 * len(_PHASES))  # the medians, then the pauses, as written (by phase)
        self._lock = threading.Lock()  # marks may come from a checkpoint writer's threads
        if directory is not None:
            self._map = _create(directory / f"rank{rank}", SIZE)
            self._write()

    @classmethod
    def open_from_env(cls, rank: int, local_rank: int, phase: Phase = Phase.STARTUP) -> ProgressBoard:
        """The rank's board, in ``phase``; one that writes nothing outside a watched job step."""
        board = cls(None, rank, local_rank)
        directory = os.environ.get(PROGRESS_DIR_ENV, "")
        if directory:
            board._phase = phase
            try:
                board._map = _create(Path(directory) / f"rank{rank}", SIZE)
                board._write()
            except OSError:  # a full or missing tmpfs costs the watcher's view, never the run
                board._map = None
        return board

    @property
    def enabled(self) -> bool:
        return self._map is not None

    @property
    def phase_now(self) -> Phase:
        return self._phase

    def phase(self, phase: Phase, budget_s: float = 0.0) -> None:
        """Enter ``phase``; the phase left is timed into its recent median. ``budget_s``: how long this
        phase may take by the rank's own estimate (a checkpoint save), 0 for none."""
        if self._map is None:
            return
        now = time.time()
        self._enter(phase, now)
        self._budget = self._phase_budget = float(budget_s)
        self._write(now)

    def mark(self, budget_s: float | None = None, share: float | None = None) -> None:
        """Progress inside the phase under way (a layer's forward or backward, an evaluation batch, a shard
        read or written, a graph compiled): its pause since the last move is measured, and the mark is
        published unless the last write is under ``MARK_GAP_S`` old. ``budget_s``: how long the work up to
        the next mark may take by the rank's own estimate; ``share``: that work's share of the phase's
        budget (a shard's bytes of a save's, so the save's estimate bounds each shard, not the whole)."""
        if self._map is None:
            return
        now = time.time()
        self._move(now)
        self._marks += 1
        if share is not None and self._phase_budget > 0:
            budget_s = self._phase_budget * share
        if budget_s is not None:
            self._budget = float(budget_s)
        elif now - self._written < MARK_GAP_S:
            return
        self._write(now, whole=False)

    def _move(self, now: float) -> None:
        pause = now - self._moved
        if pause > self._longest:
            self._longest = pause
        self._moved = now

    def _enter(self, phase: Phase, now: float) -> None:
        if phase is not self._phase:
            self._move(now)
            lengths = self._lengths[self._phase]
            lengths.append(now - self._phase_started)
            self._medians[self._phase] = statistics.median(lengths)
            pauses = self._pause_lengths[self._phase]
            pauses.append(self._longest)
            self._pauses[self._phase] = statistics.median(pauses)
            stats = self._medians, self._pauses  # packed here once, not on every write
            self._stats = tuple(d.get(p, 0.0) for d in stats for p in _PHASES)
            self._phase, self._phase_started = phase, now
            self._longest = 0.0
            self._budget = self._phase_budget = 0.0

    def step_done(self, step: int) -> None:
        """A step finished: the collectives it entered are counted for the next step's comparison."""
        if self._map is None:
            return
        self._step = step
        self._last_step_collectives, self._step_collectives = self._step_collectives, 0
        self._last_names, self._names = self._names, []
        self._enter(Phase.AFTER_STEP, time.time())
        self._per_step.append(self._last_step_collectives)
        earlier = list(self._per_step)[:-1]  # the last step is the one compared with the usual
        self._usual = statistics.mode(earlier) if earlier else 0
        self._write()

    def collective(self, name: str) -> contextlib.AbstractContextManager:
        """Around a collective relaytrain issues: entered, then left (left also when it raises)."""
        return _Collective(self, name) if self._map is not None else _UNPUBLISHED

    def _collective_entered(self, name: str) -> None:
        now = time.time()
        self._move(now)
        self._entered += 1
        self._step_collectives += 1
        self._name = encoded = _ENCODED.get(name) or _encode(name)
        index = len(self._names)
        self._expected = self._last_names[index] if index < len(self._last_names) else b""
        self._names.append(encoded)
        self._write(now, whole=False)

    def _collective_left(self) -> None:
        now = time.time()
        self._move(now)
        self._left += 1
        self._write(now, whole=False)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(ValueError, OSError):
                self.phase(Phase.DONE)
                self._map.close()
            self._map = None

    def _write(self, now: float | None = None, whole: bool = True) -> None:
        with self._lock:
            self._write_locked(time.time() if now is None else now, whole)

    def _write_locked(self, now: float, whole: bool = True) -> None:
        """The record (``whole``), or only what a collective or a mark changes (the rest as last written)."""
        m = self._map
        if m is None:  # closed by another thread
            return
        self._written = now
        self._seq += 1  # odd: a write is under way
        _HEAD.pack_into(m, 0, MAGIC, VERSION, self._seq)
        if whole:
            where = (self.rank, self.local_rank, self._pid, self._step, int(self._phase), self._phase_started)
            _PREFIX.pack_into(m, _HEAD.size, *where)
            _STATS.pack_into(m, _STATS_AT, *self._stats)
        _MOVE.pack_into(
            m,
            _MOVE_AT,
            now,
            self._budget,
            self._entered,
            self._left,
            self._name,
            self._expected,
            self._step_collectives,
            self._last_step_collectives,
            self._usual,
            self._marks,
        )
        self._seq += 1
        _HEAD.pack_into(m, 0, MAGIC, VERSION, self._seq)


class _Collective:
    """One published collective: entered on ``with``, left on its end (a class, not a generator: cheaper)."""

    __slots__ = ("board", "name")

    def __init__(self, board: ProgressBoard, name: str):
        self.board, self.name = board, name

    def __enter__(self) -> None:
        self.board._collective_entered(self.name)

    def __exit__(self, *_exc: object) -> bool:
        self.board._collective_left()
        return False


_UNPUBLISHED = contextlib.nullcontext()
_ENCODED: dict[str, bytes] = {}  # collective names as written (a few dozen distinct ones)


def _encode(name: str) -> bytes:
    encoded = _ENCODED[name] = name.encode()[:NAME_BYTES]
    return encoded


def _create(path: Path, size: int) -> mmap.mmap:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
