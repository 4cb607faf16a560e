"""Node-local memory on the local cluster: each node's slurmd (and every job process under it) runs in a
mount namespace of its own with a private tmpfs on /dev/shm, as each node of a real cluster has its own
memory. What one node keeps there (snapshots) is invisible to the other nodes and to this shell, reachable
from another node only over the network, and gone when the node's processes are."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# How the nodes run, recorded in cluster.json: a cluster started without it is restarted.
LAYOUT = "node-memory"
NODE_MEMORY = Path("/dev/shm")
# what slurmd runs in: new UTS (its hostname) and mount namespaces, mounts private to it
NAMESPACES = ["unshare", "--uts", "--mount", "--propagation", "private"]


def mount_command(node: str) -> str:
    return f"mount -t tmpfs -o mode=1777 relaytrain-{node} {NODE_MEMORY}"


def private(pids: list[int | None]) -> bool:
    """Whether every one of these processes runs in a mount namespace other than this process's."""
    ours = os.readlink("/proc/self/ns/mnt")
    try:
        return all(pid and os.readlink(f"/proc/{pid}/ns/mnt") != ours for pid in pids)
    except OSError:
        return False


def enter(pid: int, command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` in the network, mount and UTS namespaces of process `pid` (a node's slurmd)."""
    where = ["nsenter", f"--target={pid}", "--net", "--mount", "--uts"]
    return subprocess.run([*where, *command], capture_output=True, text=True, timeout=60)
