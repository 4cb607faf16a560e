"""`python -m relaytrain.job.torchrun ARGS...`: torchrun (``torch.distributed.run``) for a Slurm job step.

The same program and arguments as ``python -m torch.distributed.run``, with two differences, both about
a stop being the expected path rather than a failure:

* When a signal named in ``--signals-to-handle`` arrives (Slurm's pre-timeout signal, preemption's
  SIGTERM), torchrun forwards it to its workers, waits for them up to ``--shutdown-timeout``, and then
  raises ``SignalException`` out of its main function: Python prints that as two chained tracebacks in
  the job log at every preemption and time limit, after the workers have saved their checkpoint and
  recorded the stop. Here it is one line, and the exit code says which signal ended the step (128 + its
  number, as a shell reports it).
* When every worker that did not finish exited 75 (EX_TEMPFAIL: stopped with a checkpoint, asking to be
  continued, docs/programs.md), or one did and the agent ended the others while they were still
  exiting (it stops the rest at once when one worker ends), torchrun calls that a failure: it logs
  ``failed (exitcode: 75)``, prints a ``ChildFailedError`` traceback with a FAILED summary, and exits 1,
  so a batch script can no longer tell the agreed stop from a crash. Here it is one line and exit code 75.

A run with ``resilience.survivors`` on (its ranks say so on the agent's store, ``job/survivors.py``) adds
a third, with relaytrain's own first option ``--survivor-replacements=N`` (before torchrun's; without it
nothing is replaced): a worker whose process dies (any exit but 0 and the agreed stops) is replaced alone,
with the same command and environment, while the others stay; the replacement joins the survivors' next
round. Up to N workers are replaced so, apart from ``--max-restarts`` (torchrun's restart of every worker,
left as given: a Slurm job step runs with 0). It is the agent's standby process (``job/standby.py``:
started while replacements are left, already imported, waiting) when one is alive, else a new process (the
log says which); a new standby is started once the round's replayed step is done. After a rank reports
that its in-process recovery failed, or once N workers have been replaced, the next dead worker ends them
all and the launcher fails, with no restart of its own (torchrun's restart of every worker would meet the
old workers' keys on its store): what restarts a failed job step (the batch driver's restart in place)
runs as without survivors.

Any other worker failure keeps torchrun's own error summary and exit code. And after one, the workers
still running get ``FAILURE_SHUTDOWN_S`` to end on torchrun's SIGTERM before its SIGKILL, not its 30 s:
after a crash or a hang nothing is left for them to save (a collective with the failed rank never
completes), and one blocked in such a collective (NCCL waits for the dead peer) does not act on
SIGTERM, which held the job step, and the restart, 30 s. After agreed stops alone (``AGREED_STOPS``: every
rank stops together and rank 0 may still be writing the run's records) they keep torchrun's 30 s.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from relaytrain.job.standby import Standby
from relaytrain.job.survivors import GENERATION_ENV, REPLACEMENTS_ENV, SurvivorRounds
from relaytrain.torch_private.agent import bound_teardown_after_failure, replace_dead_workers

EXIT_RESUME = 75  # relaytrain.resilience.codes.EXIT_RESUME (job/ is below resilience/: not imported)
# relaytrain.resilience.codes: EXIT_RESUME, _RESTART_STEP, _NONFINITE, _STRAGGLER, _INTERRUPTED
AGREED_STOPS = frozenset({EXIT_RESUME, 76, 88, 89, 130})
# The others' time to act on SIGTERM after a crash or a hang: a rank's exception handler and record.
FAILURE_SHUTDOWN_S = 5
# torchrun's agent logs each failed worker here, before it knows whether all of them asked to resume.
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
REPLACEMENTS_OPTION = "--survivor-replacements"


class _HideResumeExits(logging.Filter):
    """Drop the agent's `failed (exitcode: 75) local_rank: ...` line; other failures keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        about_exit = isinstance(record.msg, str) and record.msg.startswith("failed (exitcode")
        return not (about_exit and isinstance(record.args, tuple) and record.args[:1] == (EXIT_RESUME,))


# How the agent ends the workers still running once one has exited: SIGTERM, then SIGKILL.
_ENDED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def _all_resume(exc: ChildFailedError) -> bool:
    """A worker exited 75 and every other one either did too or was ended by the agent's SIGTERM or
    SIGKILL. A worker exits 75 only after the stop every rank agreed on and the checkpoint they all
    wrote, so the others were on their way out, not failing. (Not "the first to end": torchrun stamps
    its failures to the second, and a tie names the lowest rank.)"""
    codes = [f.exitcode for f in exc.failures.values()]
    return EXIT_RESUME in codes and all(c == EXIT_RESUME or c in _ENDED_BY_AGENT for c in codes)


class _Replacements:
    """The agent's side of the survivors' rounds: which dead worker is replaced alone, and the standby process
    that replaces it (``job/standby.py``), kept while the ranks ask for survivors and their last round is
    over (its replayed step done: the next standby's imports do not compete with a recovery)."""

    STORE_TIMEOUT_S = 30.0
    STANDBY_CHECK_S = 1.0  # how often, without a standby, the agent asks its store whether one is wanted

    def __init__(self, budget: int):
        self.rounds: dict[tuple, SurvivorRounds] = {}
        self.checked_at = 0.0
        self.budget = budget  # --survivor-replacements; 0: none given, this launcher is torchrun alone
        self.left = budget  # replacements still allowed
        self.ending = False  # a dead worker ended them all: nothing more is replaced
        self.lost: tuple[int, int, int, int] = (0, 0, 0, 0)  # rank, pid, exit code, round: for `replaced`

    def _rounds(self, group, env: dict[str, str]) -> SurvivorRounds:
        key = (group.master_addr, group.master_port, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        if key not in self.rounds:
            self.rounds[key] = SurvivorRounds.connect(*key, self.STORE_TIMEOUT_S)
        return self.rounds[key]

    def replacements_left(self) -> int:
        return 0 if self.ending else self.left

    def replacement_env(
        self, group, local_rank: int, code: int, env: dict[str, str]
    ) -> dict[str, str] | bool | None:
        if code in AGREED_STOPS or not self.budget:
            return None
        if self.ending:
            return False
        worker = group.workers[local_rank]
        rounds = self._rounds(group, env)
        if not rounds.enabled():
            return None  # not a survivors run: torchrun's own handling
        # The in-process path failed, or no replacement is left: the launcher fails, and what restarts a
        # failed job step does the rest (the batch driver's restart in place). Not torchrun's restart of
        # every worker: on its store the new workers' process groups meet the old workers' keys.
        if rounds.failed():
            return self._end("the survivors' in-process recovery failed; ending every worker")
        if self.left <= 0:
            return self._end(
                f"rank {worker.global_rank} (pid {worker.id}) exited {code} and no replacement is left "
                f"({REPLACEMENTS_OPTION} used up); ending every worker"
            )
        self.left -= 1
        generation = rounds.open_generation(worker.global_rank, time.time())
        self.lost = (worker.global_rank, worker.id, code, generation)
        return {GENERATION_ENV: str(generation)}

    def _end(self, line: str) -> bool:
        _say(line)
        self.ending = True
        return False

    def replaced(self, group, local_rank: int, pid: int, standby: Standby | None) -> None:
        rank, old_pid, code, generation = self.lost
        if standby is None:
            how = f"no standby process is ready: a new process (pid {pid}) takes its place"
        else:
            warm = "" if standby.ready_after is not None else ", still importing"
            how = f"the standby process (pid {pid}{warm}) takes its place"
        _say(
            f"rank {rank} (pid {old_pid}) exited {code}; the other ranks stay: {how} in their round "
            f"{generation}"
        )

    def standby(self, group, command: list[str], env: dict[str, str]) -> Standby | None:
        """A standby started now, when the ranks ask for survivors and no round is under way."""
        now = time.monotonic()
        if now - self.checked_at < self.STANDBY_CHECK_S:
            return None
        self.checked_at = now
        rounds = self._rounds(group, env)
        if not rounds.enabled() or rounds.failed() or not rounds.settled():
            return None
        standby = Standby(command, env)
        _say(f"started a standby process (pid {standby.proc.pid}) to replace a lost rank")
        return standby

    def standby_ready(self, standby: Standby) -> None:
        pid, after = standby.proc.pid, standby.ready_after or 0.0
        _say(f"the standby process (pid {pid}) is ready ({after:.1f} s after its start)")

    def standby_exited(self, standby: Standby) -> None:
        pid, code = standby.proc.pid, standby.proc.returncode
        _say(
            f"the standby process (pid {pid}) exited {code} before a rank was lost; a lost rank's "
            "replacement will be a new process"
        )


def _say(line: str) -> None:
    print(f"relaytrain.job.torchrun: {line}", file=sys.stderr, flush=True)


def own_options(argv: list[str]) -> tuple[int, list[str]]:
    """relaytrain's option, first on the command line (torchrun's parser would take it for its own or the
    program's): the --survivor-replacements budget (0 without it) and torchrun's arguments. One line and
    exit 2 for a bad value."""
    if not argv or not argv[0].startswith(REPLACEMENTS_OPTION):
        return 0, argv
    option, given = argv[0].partition("=")[::2]
    rest = argv[1:]
    if option == REPLACEMENTS_OPTION and not given and rest:  # the value as the next word
        given, rest = rest[0], rest[1:]
    if option != REPLACEMENTS_OPTION or not given.isdigit() or int(given) < 1:
        _say(f"{argv[0]}: {REPLACEMENTS_OPTION}=N takes a whole number of 1 or more (lost ranks to replace)")
        sys.exit(2)
    return int(given), rest


def main(argv: list[str] | None = None) -> int:
    budget, argv = own_options(sys.argv[1:] if argv is None else argv)
    # The workers' Survivors (resilience/rank/survivors.py) turn on only under this launcher's budget (not
    # one a launcher above this one left in the environment).
    os.environ.pop(REPLACEMENTS_ENV, None)
    if budget:
        os.environ[REPLACEMENTS_ENV] = str(budget)
    bound_teardown_after_failure(FAILURE_SHUTDOWN_S, AGREED_STOPS)
    replace_dead_workers(_Replacements(budget))
    hide = _HideResumeExits()
    logging.getLogger(_AGENT_LOGGER).addFilter(hide)
    try:
        torchrun_main(argv)
    except SignalException as exc:
        code = 128 + int(exc.sigval)
        print(
            f"relaytrain.job.torchrun: stopped by signal {int(exc.sigval)} ({exc.sigval.name}) after "
            f"forwarding it to the workers; exit code {code}",
            file=sys.stderr,
            flush=True,
        )
        return code
    except ChildFailedError as exc:
        if not _all_resume(exc):
            raise
        ranks = ",".join(str(r) for r, f in sorted(exc.failures.items()) if f.exitcode == EXIT_RESUME)
        ended = ",".join(str(r) for r, f in sorted(exc.failures.items()) if f.exitcode != EXIT_RESUME)
        also = f" (rank {ended} ended by torchrun while exiting)" if ended else ""
        print(
            f"relaytrain.job.torchrun: workers (rank {ranks}) exited {EXIT_RESUME}{also}: stopped with a "
            f"checkpoint, to be continued; exit code {EXIT_RESUME}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RESUME
    finally:
        logging.getLogger(_AGENT_LOGGER).removeFilter(hide)
    return 0


if __name__ == "__main__":
    sys.exit(main())
