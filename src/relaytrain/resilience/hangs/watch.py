"""The node's hang watcher: a process beside the training processes of one node, outside them.

The task wrapper (``relaytrain.job.task``) starts it on each node's first task of a job step, as a child
that ignores the stop signals and dies with the task. Every second it reads its node's progress board
(``relaytrain.job.progress``: each rank's step, phase and collectives), notes how long each rank has not
moved and its process state (``stacks.process_state``), and rewrites ``RunDir.hang_node(node)``,
which the job's hang monitor (``monitor.py``, in the batch driver) reads for every node.

A rank that is stopped, blocked in the kernel, or holding the GIL cannot report on itself; this process
can. When the monitor decides the job hangs it writes ``RunDir.hang_request``; each watcher answers
with its ranks' stacks and states (``RunDir.hang_stacks(node)``), then, when the request says ``end``,
kills its ranks so that the job step ends and the end-of-step decision restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relaytrain.atomic import write_atomic
from relaytrain.entry_points import HANG_WATCH
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.progress import Phase, ProgressRecord
from relaytrain.job.progress_read import read_board
from relaytrain.resilience.hangs.stacks import describe_rank, process_state

INTERVAL_S = 1.0


def replace_file(path: Path, text: str) -> None:
    """Whole-file replace: a reader on another node never sees half a file."""
    write_atomic(path, text, durable=False)


def write_json(path: Path, data: dict[str, Any]) -> None:
    replace_file(path, json.dumps(data))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def rank_fields(record: ProgressRecord, node: str, idle_s: float) -> dict[str, Any]:
    fields = asdict(record)
    state = process_state(record.pid)
    fields.update(
        node=node,
        phase=record.phase.label,
        phase_code=int(record.phase),
        medians={p.label: v for p, v in record.medians.items()},
        pauses={p.label: v for p, v in record.pauses.items()},
        idle_s=round(idle_s, 3),
        state=state.state,
        wchan=state.wchan,
    )
    return fields


class NodeWatcher:
    """One node's view of its ranks, and its part in a hang request."""

    def __init__(
        self,
        run: RunDir,
        progress_dir: Path,
        node: str,
        job_id: str,
        step_restarts: int,
        restart_count: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run, self.progress_dir, self.node = run, progress_dir, node
        # which step of which run of the job this is: a request names the same three
        self.job_id, self.step_restarts, self.restart_count = job_id, step_restarts, restart_count
        self.clock = clock
        self._seen: dict[int, tuple[tuple[int, ...], float]] = {}  # rank -> (token, since)
        self._answered: set[str] = set()
        self._records: list[ProgressRecord] = []

    def observe(self) -> dict[str, Any]:
        """Read the board once and publish this node's view."""
        now = self.clock()
        self._records = read_board(self.progress_dir)
        ranks = []
        for record in self._records:
            token = record.token()
            seen = self._seen.get(record.rank)
            if seen is None or seen[0] != token:
                self._seen[record.rank] = seen = (token, now)
            ranks.append(rank_fields(record, self.node, now - seen[1]))
        view = {
            "node": self.node,
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "step_restarts": self.step_restarts,
            "time": time.time(),
            "pid": os.getpid(),
            "ranks": ranks,
        }
        with contextlib.suppress(OSError):
            write_json(self.run.hang_node(self.node), view)
        return view

    def request(self) -> dict[str, Any] | None:
        """The monitor's request to this job step's watchers, if there is one."""
        request = read_json(self.run.hang_request)
        if request is None or str(request.get("job_id")) != self.job_id:
            return None
        step = (request.get("restart_count"), request.get("step_restarts"))
        ours = step == (self.restart_count, self.step_restarts)
        return request if ours else None

    def answer(self, request: dict[str, Any]) -> bool:
        """Stacks for a new request, the end of the ranks when it says so. True: this watcher is done."""
        ident = str(request.get("id", ""))
        if ident and ident not in self._answered:
            self._answered.add(ident)
            self.write_stacks(ident)
        if request.get("end"):
            self.end_ranks()
            return True
        return False

    def write_stacks(self, ident: str) -> None:
        sections = [f"<!-- request {ident} -->", ""]  # the report gives each node its heading
        for record in self._records:
            sections.append(describe_rank(record.rank, record.pid, self.run.stack_dump(record.rank)))
        if not self._records:
            sections.append("(no rank of this node published its progress)")
        with contextlib.suppress(OSError):
            replace_file(self.run.hang_stacks(self.node), "\n".join(sections) + "\n")

    def end_ranks(self) -> None:
        """SIGKILL the node's ranks, this watcher's parent last (its death ends this process too)."""
        parent = os.getppid()
        pids = [r.pid for r in self._records if r.phase is not Phase.DONE]
        for pid in sorted(pids, key=lambda p: p == parent):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def clear_old_boards(progress_dir: Path) -> None:
    """Boards of this job's earlier steps on this node (a restart in place is a new step)."""
    prefix = progress_dir.name.rsplit(".", 1)[0] + "."
    with contextlib.suppress(OSError):
        for old in progress_dir.parent.glob(prefix + "*"):
            if old != progress_dir and old.is_dir():
                for f in old.iterdir():
                    with contextlib.suppress(OSError):
                        f.unlink()
                with contextlib.suppress(OSError):
                    old.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {HANG_WATCH}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--progress-dir", required=True, help="the node's progress board (tmpfs)")
    parser.add_argument("--node", default="")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--step-restarts", type=int, default=0)
    parser.add_argument("--restart-count", type=int, default=0, help="the restart count of the job")
    parser.add_argument("--interval", type=float, default=INTERVAL_S)
    args = parser.parse_args(argv)
    progress_dir = Path(args.progress_dir)
    clear_old_boards(progress_dir)
    node = args.node or JobFacts.from_env().host()
    watcher = NodeWatcher(
        RunDir(Path(args.run_dir)), progress_dir, node, args.job_id, args.step_restarts, args.restart_count
    )
    while True:
        watcher.observe()
        request = watcher.request()
        if request is not None and watcher.answer(request):
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
