"""`relaytrain cluster up|status|down`: a real Slurm cluster on this machine (docs/local-cluster.md)."""

from __future__ import annotations

import argparse
import json

from relaytrain.localcluster import cluster as local_cluster


def _progress(message: str) -> None:
    print(f"cluster: {message}", flush=True)


def _up(args: argparse.Namespace) -> int:
    info = local_cluster.cluster_up(
        nodes=args.nodes, cpus_per_node=args.cpus_per_node, base_dir=args.base_dir, report=_progress
    )
    if not info.started:
        print("The cluster was already up and healthy; nothing was started.")
    print(info.usage())
    return 0


def _down(args: argparse.Namespace) -> int:
    base = local_cluster.resolve_base_dir(args.base_dir)
    if local_cluster.cluster_down(base, report=_progress):
        print(f"Cluster in {base} stopped; logs kept in {base}/log.")
    else:
        print(f"No cluster running from {base}; nothing to stop.")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = local_cluster.cluster_status(args.base_dir)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0 if status["up"] else 1
    if not status["configured"]:
        print(f"No cluster in {status['base_dir']} (start one with `relaytrain cluster up`).")
        return 1
    print(f"Cluster in {status['base_dir']}: {'up' if status['up'] else 'NOT healthy'}")
    print(f"  export SLURM_CONF={status['slurm_conf']}")
    for daemon, alive in status["daemons"].items():
        print(f"  {daemon:<20} {'running' if alive else 'not running'}")
    if status["daemons"].get("slurmctld"):
        base = local_cluster.resolve_base_dir(args.base_dir)
        for command in (["sinfo"], ["squeue"]):
            print(f"$ {' '.join(command)}")
            done = local_cluster.run_slurm(command, base)
            print((done.stdout + done.stderr).rstrip())
    return 0 if status["up"] else 1


def register(subparsers) -> None:
    cluster = subparsers.add_parser(
        "cluster",
        help="start, inspect or stop a local multi-node Slurm cluster on this machine",
        description="A real Slurm cluster (Debian slurm-wlm + munge) with one network namespace per node.",
    )
    actions = cluster.add_subparsers(dest="cluster_command", required=True, metavar="{up,status,down}")
    base_help = f"cluster files (default ${local_cluster.BASE_DIR_ENV} or {local_cluster.DEFAULT_BASE_DIR})"

    up = actions.add_parser("up", help="start the cluster (installs Slurm with apt when missing; root)")
    up.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    up.add_argument("--cpus-per-node", type=int, default=4, help="CPUs each node offers (default 4)")
    up.add_argument("--base-dir", default=None, help=base_help)
    up.set_defaults(func=_up)

    status = actions.add_parser("status", help="daemons, nodes (sinfo) and jobs (squeue); exit 1 if not up")
    status.add_argument("--base-dir", default=None, help=base_help)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=_status)

    down = actions.add_parser("down", help="cancel jobs, stop the daemons, remove namespaces and hosts lines")
    down.add_argument("--base-dir", default=None, help=base_help)
    down.set_defaults(func=_down)
