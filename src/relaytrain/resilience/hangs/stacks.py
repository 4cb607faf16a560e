"""What a node's hang watcher can learn about one of its ranks from outside it.

* the process state and the kernel function it sleeps in (``/proc/<pid>/stat``, ``wchan``), per thread;
* its kernel stack (``/proc/<pid>/stack``, readable by root), which names the system call a rank in
  uninterruptible sleep or blocked on a dead mount waits in;
* its Python stacks: a rank that can run Python writes them itself when the watcher sends
  ``STACK_SIGNAL`` (``faulthandler.register`` in the trainer writes into ``RunDir.stack_dump(rank)``);
  a stopped rank (state T) or one in uninterruptible sleep (D) cannot, and gets none;
* a native and Python stack through ``py-spy dump --nonblocking`` where py-spy is installed (it reads a
  stopped process's memory too).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from relaytrain.job.progress import STACK_SIGNAL

CANNOT_RUN_PYTHON = frozenset("TtDZX")  # stopped, traced, uninterruptible sleep, zombie, gone
STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "zombie",
    "X": "gone",
    "I": "idle",
}
PYTHON_STACKS_WAIT_S = 3.0
PY_SPY_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ProcessState:
    state: str  # the /proc state letter; X when the process is gone
    wchan: str  # the kernel function it sleeps in ("" when running or unknown)

    @property
    def label(self) -> str:
        name = STATE_NAMES.get(self.state, self.state)
        return f"{name} (state {self.state}{', in ' + self.wchan if self.wchan else ''})"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def process_state(pid: int, tid: int | None = None) -> ProcessState:
    base = f"/proc/{pid}" if tid is None else f"/proc/{pid}/task/{tid}"
    stat = _read(f"{base}/stat")
    if not stat:
        return ProcessState("X", "")
    # The command name is in parentheses and may hold spaces: the state follows the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    state = fields[0] if fields else "?"
    wchan = _read(f"{base}/wchan").strip()
    return ProcessState(state, "" if wchan == "0" else wchan)


def thread_states(pid: int) -> list[tuple[int, str, ProcessState]]:
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return []
    return [(tid, _read(f"/proc/{pid}/task/{tid}/comm").strip(), process_state(pid, tid)) for tid in tids]


def kernel_stack(pid: int) -> str:
    return _read(f"/proc/{pid}/stack").strip()


def python_stacks(pid: int, dump_file: Path, state: ProcessState) -> str:
    """Ask the rank for its Python stacks (STACK_SIGNAL) and return what it wrote, or why there is none."""
    if state.state in CANNOT_RUN_PYTHON:
        return f"(none: the process is {state.label} and cannot run Python)"
    before = dump_file.stat().st_size if dump_file.exists() else 0
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError as error:
        return f"(none: cannot signal pid {pid}: {error.strerror})"
    deadline = time.monotonic() + PYTHON_STACKS_WAIT_S
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        with contextlib.suppress(OSError):
            now = dump_file.stat().st_size
            if now > before and now == size:  # grown, and done growing for one poll
                break
            size = now
    try:
        with open(dump_file, "rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or f"(none within {PYTHON_STACKS_WAIT_S:g} s: the rank holds the GIL or ignores the signal)"


def py_spy_dump(pid: int) -> str | None:
    """py-spy's dump of the process (native frames too), or None where py-spy is not installed."""
    tool = shutil.which("py-spy")
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(py-spy failed: {error})"
    return (done.stdout + done.stderr).strip()


def describe_rank(rank: int, pid: int, dump_file: Path) -> str:
    """A markdown section with everything this node can tell about one rank."""
    state = process_state(pid)
    lines = [f"### rank {rank} (pid {pid}): {state.label}", ""]
    threads = thread_states(pid)
    if threads:
        lines += ["threads:", "", "```"]
        lines += [f"{tid:>8} {name:<16} {s.state} {s.wchan}" for tid, name, s in threads]
        lines += ["```", ""]
    stack = kernel_stack(pid)
    if stack:
        lines += ["kernel stack:", "", "```", stack, "```", ""]
    lines += ["Python stacks:", "", "```", python_stacks(pid, dump_file, state), "```", ""]
    spy = py_spy_dump(pid)
    if spy is not None:
        lines += ["py-spy dump:", "", "```", spy, "```", ""]
    return "\n".join(lines)
