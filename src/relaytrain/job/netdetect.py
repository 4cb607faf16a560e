"""Pick the high-speed network interface for NCCL/Gloo from `ip -br addr` output.

InfiniBand (`ib*`) comes first, then HPE Slingshot (`hsn*`). Without either, NCCL and Gloo keep their
own choice. The batch job's driver sets it for the job step (resilience/batch/job_setup.py), and the task
wrapper of a step the batch shell runs alone (job/task.py), unless the config names one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from relaytrain.entry_points import NETDETECT

HIGH_SPEED_PREFIXES = ("ib", "hsn")


def parse_ip_brief(text: str) -> list[tuple[str, str, list[str]]]:
    """`ip -br addr` lines -> [(name, state, addresses)]; `ib0.8066@ib0` becomes `ib0.8066`."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        rows.append((parts[0].split("@", 1)[0], parts[1], parts[2:]))
    return rows


def detect_interface(ip_brief: str, preferred: str = "") -> str | None:
    """The interface NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME should name, or None to leave them unset.

    `preferred` (the profile's `network_interface`) wins when it is set. Otherwise the first interface
    that is up, has an address and starts with `ib`, else the first such `hsn`.
    """
    if preferred:
        return preferred
    usable = [name for name, state, addrs in parse_ip_brief(ip_brief) if state in ("UP", "UNKNOWN") and addrs]
    for prefix in HIGH_SPEED_PREFIXES:
        for name in usable:
            if name.startswith(prefix):
                return name
    return None


def high_speed_interfaces(ip_brief: str) -> list[str]:
    """Every up ib*/hsn* interface with an address (for `relaytrain doctor`)."""
    return [
        name
        for name, state, addrs in parse_ip_brief(ip_brief)
        if state in ("UP", "UNKNOWN") and addrs and name.startswith(HIGH_SPEED_PREFIXES)
    ]


def read_ip_brief() -> str:
    try:
        return subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {NETDETECT}", description=__doc__)
    parser.add_argument("--prefer", default="", help="use this interface (the profile's network_interface)")
    args = parser.parse_args(argv)
    name = detect_interface(read_ip_brief(), args.prefer)
    if name:
        print(name)
    return 0 if name else 1


if __name__ == "__main__":
    sys.exit(main())
