"""Timers that end a stuck rank: the hang watchdog and the hard deadline after a stop request.

Both end the same way (``dump_and_exit``): every thread's Python stack (faulthandler) goes to stderr
and to a file under ``<run_dir>/logs``, tagged with rank and step, then ``os._exit`` so that no
``finally`` or atexit hook can block the exit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from relaytrain.resilience.codes import EXIT_DEADLINE, EXIT_HANG

log = logging.getLogger(__name__)

# One authority (issue 53): the batch driver's hang monitor decides, within its cap
# resilience.hang_timeout_s; the in-rank watchdog is its backstop, this much later (a rank outside a
# watched Slurm job step has only the watchdog).
BACKSTOP_MULTIPLE = 1.5


def backstop_timeout_s(hang_timeout_s: float) -> float:
    """The watchdog's timeout: clearly after the hang monitor's largest limit (0: off)."""
    return BACKSTOP_MULTIPLE * float(hang_timeout_s)


def dump_stacks(header: str, path: Path | None) -> None:
    """Write ``header`` and the stacks of all threads to stderr and (appending) to ``path``."""
    line = f"{header}\n"
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file descriptor
        os.write(2, line.encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)


def dump_and_exit(header: str, path: Path, callback: Callable[[], object] | None, code: int) -> None:
    """Log ``header``, dump the stacks, run ``callback`` (whatever it raises) and exit with ``code``.

    A callback that returns False means the rank is not stuck after all: no exit.
    """
    log.error(header)
    dump_stacks(header, path)
    if callback is not None:
        try:
            if callback() is False:
                return
        except Exception:  # noqa: BLE001 - the exit below must happen whatever the callback did
            log.exception("%s callback failed", header.split(":", 1)[0])
    os._exit(code)


class HangWatchdog:
    """Exits the rank with EXIT_HANG when no step finishes within ``timeout_s``: the backstop of the job's
    hang monitor (``backstop_timeout_s``: after the monitor's cap), which decides in a watched job step.

    ``beat(step)`` after every step (and around long work such as evaluation or a save). A Python thread
    checks the time since the last beat. That thread needs the GIL, so a C call that holds the GIL
    forever would also freeze it; faulthandler's C-level timer is armed as a backstop ``backstop_s``
    after the timeout (it dumps the stacks into the same file and exits with code 1).
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        dump_file: Path | str,
        on_fire: Callable[[int], None] | None = None,
        backstop_s: float = 60.0,
    ):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.path = Path(dump_file)  # the stacks when it fires (RunDir.hang_dump)
        self.on_fire = on_fire  # called with the last step before exiting (rank 0 marks the run failed)
        self.backstop_s = backstop_s
        self._last_beat = time.monotonic()
        self._step = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_file = None
        self._armed_at: float | None = None

    @property
    def step(self) -> int:
        return self._step

    def start(self) -> None:
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._backstop_file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held until stop()
        self._last_beat = time.monotonic()
        self._stop.clear()
        self._armed_at = None
        self._arm_backstop()
        self._thread = threading.Thread(target=self._run, name=f"hang-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, step: int | None = None) -> None:
        self._last_beat = time.monotonic()
        if step is not None:
            self._step = step
        if self._thread is not None:
            self._arm_backstop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            faulthandler.cancel_dump_traceback_later()
            self._thread.join(timeout=5)
            self._thread = None
        if self._backstop_file is not None:
            self._backstop_file.close()
            self._backstop_file = None
            # faulthandler needs the file open in advance; one that never got a dump is no report.
            with contextlib.suppress(OSError):
                if self.path.stat().st_size == 0:
                    self.path.unlink()

    def _arm_backstop(self) -> None:
        # Re-arming starts a C thread, so not on every (maybe 10 ms) step: at most every backstop_s / 2,
        # which still keeps the backstop at least backstop_s / 2 behind the Python check.
        now = time.monotonic()
        if self._armed_at is not None and now - self._armed_at < self.backstop_s / 2:
            return
        self._armed_at = now
        faulthandler.dump_traceback_later(
            self.timeout_s + self.backstop_s, exit=True, file=self._backstop_file
        )

    def _run(self) -> None:
        poll = min(max(self.timeout_s / 20, 0.05), 5.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last_beat
            if idle < self.timeout_s:
                continue
            header = (
                f"relaytrain hang watchdog: rank {self.rank} step {self._step}: no step finished for "
                f"{idle:.0f} s (the backstop at {self.timeout_s:g} s = {BACKSTOP_MULTIPLE:g} x "
                f"resilience.hang_timeout_s, after the hang monitor's cap: the monitor decides in a Slurm "
                f"job, this fires only where it did not); stacks follow, exiting with code {EXIT_HANG}"
            )
            on_fire = functools.partial(self.on_fire, self._step) if self.on_fire else None
            dump_and_exit(header, self.path, on_fire, EXIT_HANG)


class HardDeadline:
    """After a stop request, exit EXIT_DEADLINE once ``deadline_s`` passed, even if the save hangs.

    ``arm()`` starts a polling thread; ``trigger()`` starts the clock and only assigns an attribute,
    so a signal handler may call it (starting a thread or taking a lock there could deadlock against the
    interrupted main thread). ``on_expire()`` runs before the exit: rank 0 records the stop and
    requeues, so the job still resumes from the previous checkpoint; it returns False when the stop
    completed meanwhile (no exit).

    Python runs a signal handler only when the main thread is between bytecodes, so a rank blocked in
    a collective would start the clock only when the collective returns (collective_timeout_s later).
    ``arm(wakeup_fd, signals)`` therefore also watches the read end of ``signal.set_wakeup_fd``'s
    pipe, to which the C-level handler writes each signal number at once: the clock starts when a
    stop signal arrives, whatever the main thread is doing.
    """

    def __init__(
        self,
        deadline_s: float,
        rank: int,
        dump_file: Path | str,
        describe: Callable[[], str],
        on_expire: Callable[[], None] | None = None,
    ):
        self.deadline_s = float(deadline_s)
        self.rank = rank
        self.path = Path(dump_file)  # the stacks when it expires (RunDir.deadline_dump)
        self.describe = describe  # "step N, reason R" at expiry time
        self.on_expire = on_expire
        self.triggered_at: float | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup_fd: int | None = None
        self._signals: frozenset[int] = frozenset()

    def arm(self, wakeup_fd: int | None = None, signals: frozenset[int] = frozenset()) -> None:
        if self._thread is not None or self.deadline_s <= 0:
            return
        self._wakeup_fd, self._signals = wakeup_fd, signals
        self._cancel.clear()
        self._thread = threading.Thread(target=self._run, name=f"hard-deadline-rank{self.rank}", daemon=True)
        self._thread.start()

    def trigger(self) -> None:
        if self.triggered_at is None:
            self.triggered_at = time.monotonic()

    def cancel(self) -> None:
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def armed(self) -> bool:
        return self._thread is not None

    def _wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; start the clock if a stop signal's number arrives. True: cancelled."""
        if self._wakeup_fd is None:
            return self._cancel.wait(seconds)
        try:
            readable, _, _ = select.select([self._wakeup_fd], [], [], seconds)
            if readable and self._signals.intersection(os.read(self._wakeup_fd, 64)):
                self.trigger()
        except (OSError, ValueError):  # the pipe was closed under us: fall back to plain polling
            self._wakeup_fd = None
        return self._cancel.is_set()

    def _run(self) -> None:
        poll = min(0.5, self.deadline_s / 10)
        while not self._wait(poll):
            if self.triggered_at is not None and time.monotonic() - self.triggered_at >= self.deadline_s:
                break
        else:
            return
        header = (
            f"relaytrain hard deadline: rank {self.rank} ({self.describe()}): still running "
            f"{self.deadline_s:g} s after the stop request (resilience.hard_deadline_s); stacks follow, "
            f"exiting with code {EXIT_DEADLINE}"
        )
        dump_and_exit(header, self.path, self.on_expire, EXIT_DEADLINE)
