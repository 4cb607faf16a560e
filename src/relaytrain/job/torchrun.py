"""`python -m relaytrain.job.torchrun ARGS...`: torchrun (``torch.distributed.run``) for a Slurm job step.

The same program and arguments as ``python -m torch.distributed.run``, with one difference. When a signal
named in ``--signals-to-handle`` arrives (Slurm's pre-timeout signal, preemption's SIGTERM), torchrun
forwards it to its workers, waits for them up to ``--shutdown-timeout``, and then raises
``SignalException`` out of its main function: Python prints that as two chained tracebacks in the job log
at every preemption and time limit, after the workers have saved their checkpoint and recorded the stop.
A stop is the expected path, so here it is one line, and the exit code says which signal ended the step
(128 + its number, as a shell reports it). Worker failures keep torchrun's own error summary.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as exc:
        code = 128 + int(exc.sigval)
        print(
            f"relaytrain.job.torchrun: stopped by signal {int(exc.sigval)} ({exc.sigval.name}) after "
            f"forwarding it to the workers; exit code {code}",
            file=sys.stderr,
            flush=True,
        )
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
