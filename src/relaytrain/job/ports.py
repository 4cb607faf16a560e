"""MASTER_PORT: derived from the job id so every rank computes the same port, then checked for use.

The batch job's driver picks the first step's port on the first node, where rank 0 listens
(``resilience/batch/job_setup.py``; an attached script runs ``python -m relaytrain.job.ports JOB_ID``
there), and
exports it, so all ranks share it; it picks the port of a job step restarted in place with
``choose_port(f"{job_id}+{restarts}", has_no_listener)``: hashed, so it is not
another job's first port.
"""

from __future__ import annotations

import socket
import sys
import zlib
from collections.abc import Callable

PORT_MIN = 15000
PORT_MAX = 20000
_SPAN = PORT_MAX - PORT_MIN + 1


def base_port(job_id: str | int) -> int:
    """Deterministic port in [PORT_MIN, PORT_MAX] for a job id (non-numeric ids are hashed)."""
    text = str(job_id)
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return PORT_MIN + number % _SPAN


def port_is_free(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def has_no_listener(port: int) -> bool:
    """Whether nothing listens on ``port`` here: only a listener blocks torch's TCPStore, which binds with
    SO_REUSEADDR, so a bind with it fails exactly then (TIME-WAIT sockets that a requeued job's earlier
    run leaves do not count; counting them moved requeued jobs onto each other's ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def choose_port(job_id: str | int, is_free: Callable[[int], bool] = port_is_free) -> int:
    """The first free port from base_port(job_id) on, wrapping around inside the range."""
    start = base_port(job_id) - PORT_MIN
    for i in range(_SPAN):
        port = PORT_MIN + (start + i) % _SPAN
        if is_free(port):
            return port
    raise RuntimeError(f"no free port in [{PORT_MIN}, {PORT_MAX}]")


if __name__ == "__main__":
    print(choose_port(sys.argv[1] if len(sys.argv) > 1 else "0", has_no_listener))
