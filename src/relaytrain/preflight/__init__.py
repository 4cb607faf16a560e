"""`relaytrain preflight`: every node checked in seconds before a run trains on it.

Each rank measures its node (`measure.py`: a GEMM's rate, an all-reduce's bandwidth, free host memory and
/dev/shm, the checkpoint directory's free space and a write-read-fsync, NVML's health of a GPU); what the
run needs comes from `relaytrain plan` (`needs.py`); `judge.py` (pure) compares each node with the
median of the job's nodes and with the needs; `run.py` gathers the results on rank 0 and writes
`<run_dir>/preflight/<job>.json`; `commands.py` is the command.
"""
