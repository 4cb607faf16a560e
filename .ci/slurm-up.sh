#!/usr/bin/env bash
# Start the local Slurm cluster for the Slurm tests (docs/local-cluster.md). Needs root.
# Installs Debian's slurm-wlm daemons and munge when missing, then `relaytrain cluster up`, which
# waits until every node is idle. Extra arguments go to it (e.g. --nodes 4). CI stops the cluster
# at the end with `relaytrain cluster down`.
set -euo pipefail

for program in slurmctld slurmd sbatch munged ip nsenter; do
  if ! command -v "$program" >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null
    break
  fi
done

relaytrain cluster up --nodes 3 --cpus-per-node 4 "$@"
