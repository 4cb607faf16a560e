"""A warm standby: a process started ahead of a fault with the workers' command, that has imported what a
rank imports and waits to take a lost rank's place (``resilience.survivors``, docs/resilience.md).

torchrun's agent (``job/torchrun.py``, through ``torch_private/agent.py``) starts one per agent with the
environment its workers share and a pipe (``STANDBY_ENV`` names its descriptor). The process runs the
workers' command up to `become_rank`: it imports what it is given to, tells the agent it is ready
(one byte on a second pipe), and blocks in a read of the first one: no CPU while it waits. When a worker
dies, the agent writes the dead rank's whole environment and output files on the pipe and closes it; the
standby takes them and carries on as that rank, with its pid. When the agent ends it (the job ends, the
workers are stopped) it is killed; when the agent dies, its end of the pipe closes and the read returns
nothing: the standby exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

STANDBY_ENV = "RELAYTRAIN_STANDBY_FD"  # "<read fd>,<ready fd>": set only in a standby process
# Stop signals a standby does not keep for later (the training command captures them before its
# imports): it has nothing to save, so one ends it.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class Standby:
    """The agent's side: the standby process (`proc`, in its own session as torchrun's workers are),
    started with `command` and `env`."""

    def __init__(self, command: list[str], env: dict[str, str]):
        read, self._write = os.pipe()
        self._ready, ready_write = os.pipe()
        os.set_blocking(self._ready, False)
        try:
            self.proc = subprocess.Popen(
                command,
                env={**env, STANDBY_ENV: f"{read},{ready_write}"},
                pass_fds=(read, ready_write),
                start_new_session=True,
            )
        finally:
            os.close(read)
            os.close(ready_write)
        self.started_at = time.monotonic()
        self.ready_after: float | None = None  # seconds from the start to its ready byte
        self.became = False

    def ready(self) -> bool:
        """Whether it has imported everything and waits (checked without blocking)."""
        if self.ready_after is None and self._ready >= 0:
            try:
                got = os.read(self._ready, 1)
            except BlockingIOError:
                return False
            if got:
                self.ready_after = time.monotonic() - self.started_at
            os.close(self._ready)
            self._ready = -1
        return self.ready_after is not None

    def become(self, env: dict[str, str], stdout: str | None, stderr: str | None) -> None:
        """Hand it a rank: `env` (the rank's whole environment) and where its output goes (None: the
        agent's own, as for a worker without redirects). Raises OSError when it has died meanwhile."""
        message = json.dumps({"env": env, "stdout": stdout or "", "stderr": stderr or ""}).encode()
        write, self._write = self._write, -1
        self.became = True
        with os.fdopen(write, "wb") as pipe:
            pipe.write(message)

    def end(self) -> None:
        """Kill it, unless it has become a rank, and reap it (no process is left behind). Killed before its
        pipe closes: the closed pipe alone would end it too, but later and by its own exit."""
        if not self.became and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(self.proc.pid, signal.SIGKILL)
        for fd in (self._write, self._ready):
            if fd >= 0:
                os.close(fd)
        self._write = self._ready = -1
        if not self.became:
            self.proc.wait()


def become_rank(warm_up: Callable[[], object]) -> None:
    """In a standby process: `warm_up()` (the imports), say ready, wait for a rank and take it (its
    environment, its output files); return as that rank. The agent gone first: exit. Elsewhere: nothing."""
    fds = os.environ.get(STANDBY_ENV)
    if not fds:
        return
    read, ready = (int(fd) for fd in fds.split(","))
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    warm_up()
    os.write(ready, b"r")
    os.close(ready)
    waited = time.monotonic()
    chunks = []
    while chunk := os.read(read, 1 << 16):  # blocks: the agent writes once, then closes its end
        chunks.append(chunk)
    os.close(read)
    if not chunks:
        os._exit(0)  # the agent ended without needing it
    message = json.loads(b"".join(chunks))
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fileno in ((message["stdout"], 1), (message["stderr"], 2)):
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, fileno)
            os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    print(
        f"relaytrain: the standby process (pid {os.getpid()}) becomes rank {os.environ.get('RANK', '?')} "
        f"after waiting {time.monotonic() - waited:.1f} s",
        file=sys.stderr,
        flush=True,
    )
