"""Whole-file writes that a reader (another process, another node, the next job after a crash) sees
either before or after, never half-done: written under a temporary name beside the target, then renamed
over it. The one helper for every such write in the package (tests/test_atomic.py proves it).

``durable=True`` also survives the node's crash, not only the process's: the file is fsynced before the
rename and its folder after it (checkpoint files, whose sizes and checksums a manifest commits). Records
read back by the same job (run_state.json, the hang record, caches) pass ``durable=False``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


def temp_name(path: Path) -> Path:
    """A name beside ``path`` that no other writer uses (host, process and thread), ending in ``.tmp``."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by its name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Path, *, durable: bool) -> Iterator[Path]:
    """Yield a temporary path for the caller to create the new file at (a writer that wants a file name:
    ``torch.save``, a tokenizer's ``save``, a symlink); on leaving, rename it over ``path``. An error
    leaves ``path`` as it was and no temporary behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        if durable and not tmp.is_symlink():
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
    if durable:
        fsync_path(path.parent)


def write_chunks(path: Path, chunks: Iterable[bytes], *, durable: bool) -> None:
    """Replace ``path`` by the concatenation of ``chunks`` (written as they come: no copy is held)."""
    with replacing(path, durable=durable) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


def write_atomic(path: Path, data: bytes | str, *, durable: bool) -> None:
    """Replace ``path`` by ``data`` (text is written as UTF-8)."""
    write_chunks(path, [data.encode("utf-8") if isinstance(data, str) else data], durable=durable)
