"""The verdict of preflight (pure): each node against the median of the job's nodes and against the run's
needs, one line per node that falls short.

A node's figure is its worst rank's (the lowest rate, the least free space). Thresholds
(docs/howto/preflight.md; measured on the local cluster by bench/preflight.py):
- compute: a node whose GEMM rate is more than `compute_pct` % below the median;
- network: a node whose all-reduce bandwidth is more than `network_pct` % below the median;
- memory, /dev/shm, storage: less free than the plan's need; a failed write-read-fsync;
- GPU (NVML): uncorrected ECC errors, pages pending retirement, a temperature over `max_temp_c`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Thresholds:
    compute_pct: float = 40.0  # a clean node: up to 15 % below alone, 27 % beside another job's ranks
    network_pct: float = 50.0
    max_temp_c: float = 90.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def node_figures(ranks: list[dict]) -> dict[str, dict]:
    """Rank results -> per node (in rank order): the worst rank's figure of each measurement."""
    nodes: dict[str, dict] = {}
    for result in sorted(ranks, key=lambda r: r["rank"]):
        node = nodes.setdefault(result["node"], {"ranks": [], "gpus": [], "errors": []})
        node["ranks"].append(result["rank"])
        for key, value in result.get("figures", {}).items():
            if value is None:
                continue
            old = node.get(key)  # every figure is better higher: a rate, free bytes
            node[key] = value if old is None else min(old, value)
        if result.get("gpu"):
            node["gpus"].append(result["gpu"])
        if result.get("storage_error"):
            node["errors"].append(result["storage_error"])
    return nodes


def _below_median(nodes: dict[str, dict], key: str, pct: float, what: str, unit: str) -> dict[str, str]:
    values = [node[key] for node in nodes.values() if node.get(key) is not None]
    if len(values) < 2:
        return {}
    median = statistics.median(values)
    found = {}
    for name, node in nodes.items():
        value = node.get(key)
        if value is None or median <= 0:
            continue
        short = (median - value) / median * 100
        if short > pct:
            found[name] = f"{what} {short:.0f} % below the median ({value:.1f} vs {median:.1f} {unit})"
    return found


def _short_of_need(free: float | None, need: float, what: str) -> str | None:
    if free is None or not need or free >= need:
        return None
    unit, name = (GIB, "GiB") if need >= GIB else (MIB, "MiB")  # a small need in GiB reads "0.0 GiB"
    return f"{what} {free / unit:.1f} {name} free of the {need / unit:.1f} {name} the run needs"


def judge(
    ranks: list[dict], needs: dict[str, float], limits: Thresholds = Thresholds()
) -> dict[str, list[str]]:
    """{node: [what falls short]} for every node (empty list: the node passed)."""
    nodes = node_figures(ranks)
    problems: dict[str, list[str]] = {name: [] for name in nodes}
    for key, pct, what, unit in (
        ("gflops", limits.compute_pct, "compute", "GFLOP/s"),
        ("gbps", limits.network_pct, "network", "GB/s"),
    ):
        for name, line in _below_median(nodes, key, pct, what, unit).items():
            problems[name].append(line)
    for name, node in nodes.items():
        for key, need_key, what in (
            ("host_free_bytes", "host_bytes", "host memory"),
            ("shm_free_bytes", "shm_bytes", "/dev/shm"),
            ("storage_free_bytes", "save_bytes", "checkpoint storage"),
        ):
            line = _short_of_need(node.get(key), needs.get(need_key, 0.0), what)
            if line:
                problems[name].append(line)
        problems[name] += [f"checkpoint storage {error}" for error in node["errors"]]
        for gpu in node["gpus"]:
            problems[name] += _gpu_problems(gpu, limits)
    return problems


def _gpu_problems(gpu: dict, limits: Thresholds) -> list[str]:
    found = []
    if gpu.get("ecc_uncorrected"):
        found.append(f"GPU {gpu.get('index')}: {gpu['ecc_uncorrected']} uncorrected ECC errors")
    if gpu.get("retired_pages_pending"):
        found.append(f"GPU {gpu.get('index')}: pages pending retirement (reset the GPU)")
    temp = gpu.get("temperature_c")
    if temp is not None and temp > limits.max_temp_c:
        found.append(f"GPU {gpu.get('index')}: {temp} C, over {limits.max_temp_c:g} C")
    return found


def report_lines(problems: dict[str, list[str]]) -> list[str]:
    """One line per node that falls short: `preflight: NODE what; what`."""
    return [f"preflight: {node} {'; '.join(found)}" for node, found in problems.items() if found]


def summary(problems: dict[str, list[str]]) -> str:
    bad = [node for node, found in problems.items() if found]
    if not bad:
        return f"{len(problems)} node(s) passed"
    return f"{len(bad)} of {len(problems)} node(s) below threshold: {', '.join(bad)}"
