"""One start or stop of the local cluster at a time.

Two callers can race to start the cluster: two test workers, two shells, a test's fixture beside a
user's ``relaytrain cluster up``. Each would create the same network namespaces and start a second
munged, and one of them fails half-way (``ip netns add ... File exists``). ``cluster_up`` and
``cluster_down`` therefore hold an exclusive lock on a file beside the cluster's folder (beside it, not
in it: a start may remove and recreate the folder); the second caller waits for the first and then
finds its cluster up and reuses it. The lock is re-entrant within a process, since ``cluster_up`` stops
leftovers with ``cluster_down``.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from relaytrain.errors import UserError

WAIT_S = 600.0  # a start waits for nodes up to a minute per step; a stop cancels jobs first
_held: dict[Path, int] = {}  # lock file -> depth, for this process
_guard = threading.Lock()


def lock_path(base: Path) -> Path:
    return base.parent / f"{base.name}.lock"


@contextmanager
def held(base: Path, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the cluster's lock (waiting up to ``wait_s`` for another holder)."""
    path = lock_path(base)
    with _guard:
        if _held.get(path):
            _held[path] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _guard:
                _held[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with _guard:
            _held[path] = 1
        try:
            yield
        finally:
            with _guard:
                _held.pop(path, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise UserError(
                    f"another start or stop of the local cluster (pid {holder}) has held {path} for "
                    f"{wait_s:.0f} s; wait for it to finish, or stop that process and run the command again"
                ) from None
            time.sleep(0.2)


def serialized(resolve_base_dir: Callable[[object], Path]) -> Callable[[Callable], Callable]:
    """Run the decorated function (which takes ``base_dir``) under the lock of the cluster it acts on;
    ``resolve_base_dir`` turns that argument into the cluster's folder."""

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            with held(resolve_base_dir(bound.arguments.get("base_dir"))):
                return func(*args, **kwargs)

        return wrapper

    return decorate
