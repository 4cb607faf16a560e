#!/bin/sh
# The first hour on a GPU machine (bench/gpu_first_hour.py): versions, bf16 matmul peak, a single-GPU
# run, sync/async save and resume, snapshots of a 0.4 B state, a compile deeper than the recompile
# limit, bench/gpu_mfu.py, and the parallel layouts on 2-8 GPUs; figures into docs/benchmarks.md.
# No network and no installed console script needed. Without a CUDA GPU: one line, exit 0.
cd "$(dirname "$0")/.." || exit 1
PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m bench.gpu_first_hour "$@"
