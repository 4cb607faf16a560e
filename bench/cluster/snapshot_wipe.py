"""`python -m bench.cluster.snapshot_wipe SNAPSHOT_DIR JOB_ID [--rank R]`: remove Slurm job JOB_ID's
in-memory snapshots from the memory of the node it runs on: all of them (the node lost its memory), or
only rank R's files, its own and the replicas of it. The chaos trials run it on a node of the local
cluster through `relaytrain.localcluster.cluster.on_node` (each node has its own /dev/shm); it prints
what it removed, one path a line."""

from __future__ import annotations

import argparse
import shutil
import sys

from relaytrain.checkpoint.snapshot import store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.snapshot_wipe", description=__doc__)
    parser.add_argument("snapshot_dir", help="checkpoint.snapshot_dir of the run")
    parser.add_argument("job_id")
    parser.add_argument("--rank", type=int, default=None, help="only this rank's files (default: all)")
    args = parser.parse_args(argv)
    for root in store.job_dirs(args.snapshot_dir, args.job_id):
        if args.rank is None:
            shutil.rmtree(root, ignore_errors=True)
            print(root)
            continue
        for node_dir in store.node_dirs(root):
            for path in store.remove_rank(node_dir, args.rank):
                print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
