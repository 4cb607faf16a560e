"""Network namespaces, veth pairs and /etc/hosts entries for the local Slurm cluster.

Layout: the namespace ``rlt-br`` holds a bridge; the root namespace gets one veth end on it
(``rlt-host``, the controller address 10.250.0.1) and each node K gets its own namespace ``rlt-nK``
whose ``eth0`` (10.250.0.(10+K)) is plugged into the same bridge. Deleting the namespaces removes
every link, so nothing outlives ``cluster down``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NETNS_DIR = Path("/run/netns")
BRIDGE_NS = "rlt-br"
BRIDGE = "br0"
HOST_VETH = "rlt-host"
NODE_NS_PREFIX = "rlt-n"
SUBNET_PREFIX = "10.250.0"
CONTROLLER_ADDR = f"{SUBNET_PREFIX}.1"
CONTROLLER_NAME = "nsctl"
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# relaytrain-cluster"


def node_name(index: int) -> str:
    return f"nsnode{index}"


def node_addr(index: int) -> str:
    return f"{SUBNET_PREFIX}.{10 + index}"


def node_netns(index: int) -> str:
    return f"{NODE_NS_PREFIX}{index}"


def node_index(name: str) -> int:
    if not name.startswith("nsnode") or not name[len("nsnode") :].isdigit():
        raise ValueError(f"not a local cluster node name: {name!r}")
    return int(name[len("nsnode") :])


def netns_path(ns: str) -> Path:
    return NETNS_DIR / ns


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


def _link_exists(name: str, netns: str | None = None) -> bool:
    return _ip("link", "show", name, netns=netns, check=False).returncode == 0


def _ensure_netns(ns: str) -> None:
    if not netns_path(ns).exists():
        _ip("netns", "add", ns)
    _ip("link", "set", "lo", "up", netns=ns)


def _ensure_bridge() -> None:
    _ensure_netns(BRIDGE_NS)
    if not _link_exists(BRIDGE, BRIDGE_NS):
        _ip("link", "add", BRIDGE, "type", "bridge", netns=BRIDGE_NS)
    _ip("link", "set", BRIDGE, "up", netns=BRIDGE_NS)


def _plug_into_bridge(bridge_end: str) -> None:
    _ip("link", "set", bridge_end, "master", BRIDGE, netns=BRIDGE_NS)
    _ip("link", "set", bridge_end, "up", netns=BRIDGE_NS)


def _ensure_host_link() -> None:
    if _link_exists(HOST_VETH):
        return
    bridge_end = f"{HOST_VETH}-b"
    _ip("link", "add", HOST_VETH, "type", "veth", "peer", "name", bridge_end, "netns", BRIDGE_NS)
    _ip("addr", "add", f"{CONTROLLER_ADDR}/24", "dev", HOST_VETH)
    _ip("link", "set", HOST_VETH, "up")
    _plug_into_bridge(bridge_end)


def _ensure_node_link(index: int) -> None:
    ns = node_netns(index)
    _ensure_netns(ns)
    if _link_exists("eth0", ns):
        return
    temp, bridge_end = f"{ns}-v", f"{ns}-b"
    if _link_exists(temp):
        _ip("link", "del", temp)
    _ip("link", "add", temp, "type", "veth", "peer", "name", bridge_end, "netns", BRIDGE_NS)
    _ip("link", "set", temp, "netns", ns)
    _ip("link", "set", temp, "name", "eth0", netns=ns)
    _ip("addr", "add", f"{node_addr(index)}/24", "dev", "eth0", netns=ns)
    _ip("link", "set", "eth0", "up", netns=ns)
    _plug_into_bridge(bridge_end)


def ensure_network(nodes: int) -> None:
    """Create (or complete) the bridge, the root namespace's link and one namespace per node."""
    _ensure_bridge()
    _ensure_host_link()
    for index in range(1, nodes + 1):
        _ensure_node_link(index)


def our_namespaces() -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    names = [p.name for p in NETNS_DIR.iterdir()]
    return sorted(n for n in names if n == BRIDGE_NS or n.startswith(NODE_NS_PREFIX))


def remove_network() -> None:
    """Delete every namespace this module made; the veth pairs go with them."""
    for ns in our_namespaces():
        _ip("netns", "del", ns, check=False)
    if _link_exists(HOST_VETH):
        _ip("link", "del", HOST_VETH, check=False)


def pids_in_netns(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (e.g. a node's slurmd, slurmstepd and job tasks)."""
    try:
        target = os.stat(netns_path(ns))
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
            pids.append(int(entry))
    return pids


def hosts_entries(nodes: int) -> list[str]:
    lines = [f"{CONTROLLER_ADDR} {CONTROLLER_NAME} {HOSTS_MARKER}"]
    lines += [f"{node_addr(k)} {node_name(k)} {HOSTS_MARKER}" for k in range(1, nodes + 1)]
    return lines


def _write_hosts(lines: list[str]) -> None:
    # In place, not by rename: /etc/hosts is often a bind mount in containers.
    with open(HOSTS_FILE, "w") as handle:
        handle.write("".join(line + "\n" for line in lines))


def set_hosts_entries(nodes: int) -> None:
    current = HOSTS_FILE.read_text().splitlines() if HOSTS_FILE.exists() else []
    kept = [line for line in current if not line.endswith(HOSTS_MARKER)]
    wanted = kept + hosts_entries(nodes)
    if wanted != current:
        _write_hosts(wanted)


def remove_hosts_entries() -> None:
    if not HOSTS_FILE.exists():
        return
    current = HOSTS_FILE.read_text().splitlines()
    kept = [line for line in current if not line.endswith(HOSTS_MARKER)]
    if kept != current:
        _write_hosts(kept)
