"""`python -m bench.goodput`: goodput under preemption and time limits (bench/cluster/goodput.py)."""

import sys

from bench.cluster.goodput import main

if __name__ == "__main__":
    sys.exit(main())
