"""What the batch job's driver sets up before its first job step, on the allocation's first node (the
batch script only prepares the environment and hands over, docs/architecture.md "The launch path"):

* the job's nodes, split into the training nodes and the spares (``slurm.spare_nodes``);
* MASTER_ADDR (the first training node) and MASTER_PORT (derived from the job id, the first one from
  there that nothing listens on: ``job.ports.choose_port``);
* the high-speed interface for NCCL and Gloo (``job.netdetect``), unless the config named one;
* the job log's record of the environment: the job, the variables that matter (secrets left out), the
  GPUs, and the Python packages.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path

from relaytrain.job import JobFacts
from relaytrain.job.netdetect import detect_interface, read_ip_brief
from relaytrain.job.ports import choose_port, has_no_listener
from relaytrain.resilience.batch.job_step import log
from relaytrain.resilience.batch.spares import JobNodes, split_nodes

RECORDED = re.compile(r"^(SLURM_|NCCL_|GLOO_|CUDA_|ROCR_|HIP_|TORCH|OMP_|MASTER_|PYTHON|MIOPEN_)")
SECRET = re.compile(r"^[^=]*(TOKEN|SECRET|PASSWORD|KEY)[^=]*=", re.IGNORECASE)
# what `pip freeze` leaves out unless given --all
PACKAGING_TOOLS = frozenset({"pip", "setuptools", "wheel", "distribute"})
PACKAGES = re.compile(r"^(torch|relaytrain|numpy|triton|nvidia-nccl|deepspeed|lightning|megatron)", re.I)


def set_master(environ: MutableMapping[str, str], job: JobFacts, nodes: list[str]) -> None:
    """MASTER_ADDR and MASTER_PORT for the first step (a restart in place picks its own port)."""
    environ["MASTER_ADDR"] = nodes[0] if nodes else "127.0.0.1"
    environ["MASTER_PORT"] = str(choose_port(job.job_id or "0", has_no_listener))


def set_interface(environ: MutableMapping[str, str]) -> None:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the first up ib*, else hsn*, unless already set."""
    if environ.get("NCCL_SOCKET_IFNAME"):
        name = environ["NCCL_SOCKET_IFNAME"]
    elif name := detect_interface(read_ip_brief()) or "":
        environ["NCCL_SOCKET_IFNAME"] = environ["GLOO_SOCKET_IFNAME"] = name
    if name:
        log(f"high-speed interface: {name} (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
    else:
        log("no ib*/hsn* interface found: NCCL and Gloo choose their own")


def _output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def installed_packages() -> list[str]:
    """This interpreter's packages as `pip freeze` lists them (``name==version``, sorted), an editable
    install with where it comes from as a comment. Read in this process: the batch script runs the
    driver with the job's Python, and `pip freeze` in a process of its own cost about a second of CPU
    a job."""
    found: dict[str, str] = {}
    # sys.path less the folders inside a package: setuptools, once imported, appends its _vendor folder,
    # whose copies are no installed packages
    path = [entry for entry in sys.path if not (Path(entry or ".").parent / "__init__.py").is_file()]
    for dist in importlib.metadata.distributions(path=path):  # sys.path order: the first one wins
        name = dist.metadata["Name"]
        if not name or name.lower() in found or name.lower() in PACKAGING_TOOLS:
            continue
        line = f"{name}=={dist.version}"
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            url = {}
        if isinstance(url, dict) and (url.get("dir_info") or {}).get("editable"):
            line += f"  # editable install from {url.get('url', '')}"
        found[name.lower()] = line
    return [found[key] for key in sorted(found)]


def record_environment(environ: MutableMapping[str, str], gpu_tool: str, freeze: Path | None):
    """The environment in the job log: the variables, the GPUs (``gpu_tool``: nvidia-smi or rocm-smi, when
    installed) and, with ``freeze``, the Python packages (the whole list kept in that file)."""
    log("environment:")
    lines = sorted(f"{k}={v}" for k, v in environ.items() if RECORDED.match(k))
    print("".join(f"    {line}\n" for line in lines if not SECRET.match(line)), end="", flush=True)
    if (gpus := _output([gpu_tool])) is not None:
        print(gpus, end="", flush=True)
    if freeze is not None:
        packages = installed_packages()
        freeze.parent.mkdir(parents=True, exist_ok=True)
        freeze.write_text("".join(f"{line}\n" for line in packages), encoding="utf-8")
        log(f"python packages: {len(packages)} (full list in {freeze})")
        shown = [f"    {line}\n" for line in packages if PACKAGES.match(line)]
        print("".join(shown), end="", flush=True)


def prepare(environ: MutableMapping[str, str], training: int, processes_per_node: int) -> JobNodes:
    """The nodes, the master, the interface, and the job's first log lines."""
    job = JobFacts.from_env(environ)
    nodes = split_nodes(job, training)
    set_master(environ, job, nodes.training)
    hosts = [*nodes.training, *nodes.spares]
    shape = f"{len(hosts)} node(s) x {processes_per_node} task(s)"
    log(f"job {job.job_id}: restart count {job.restart_count}, {shape}: {' '.join(hosts)}")
    log(f"master: {environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
    if nodes.spares:
        log(f"training nodes: {','.join(nodes.training)}; spare nodes: {','.join(nodes.spares)}")
    set_interface(environ)
    return nodes
