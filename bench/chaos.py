"""`python -m bench.chaos`: the chaos benchmark on the local Slurm cluster (bench/cluster/chaos.py)."""

import sys

from bench.cluster.chaos import main

if __name__ == "__main__":
    sys.exit(main())
