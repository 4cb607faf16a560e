"""``<run_dir>/run.lock``: one writer per run directory.

Rank 0 of ``relaytrain train`` (and a ``relaytrain.program`` program) takes the lock before it writes
anything into the run directory, holds it for the run and removes it at exit, a graceful stop or an
exception. The file names its holder: the Slurm job (array-aware id, restart count), the host, the pid
and the pid's start identity (boot id and start time, so a recycled pid is not taken for the holder).

A second start finds the lock and asks whether the holder is alive:

* the holder is an earlier run of the same Slurm job (a requeue comes back with the same id and a
  higher restart count): it is this job's own lock, taken over;
* the holder is another Slurm job: alive while Slurm says it may still run (pending, running,
  requeued, suspended, ...), even between its job steps; dead once it ended or Slurm forgot it;
* otherwise (no Slurm job, or Slurm cannot be asked): alive while its process is, on the same host;
  a holder on another host cannot be checked and counts as alive.

A live holder is refused in one line that names it and what to do; a dead one is taken over with a
log line naming it. Creation is atomic on NFS and Lustre: the record is written to a private file and
hard-linked to ``run.lock`` (a link either exists or not; a reply lost after the link is detected by
the link count), with ``O_CREAT|O_EXCL`` where the filesystem has no hard links. Two starts racing for
a stale lock each rename it away first, and only the one whose renamed file is still the stale record
goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from relaytrain.errors import USAGE_EXIT_CODE, UserError
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.slurmctld import job_is_over, queue_states
from relaytrain.resilience.run_kind import TRAIN, RunKind, claim_kind

log = logging.getLogger(__name__)

BUSY_WORDS = " is in use by "  # in every refusal; the crash check finds a refused step by it
UNREADABLE_GRACE_S = 60.0  # an unreadable lock younger than this may still be being written
TAKEOVER_GRACE_S = 10.0  # a takeover guard older than this was left by a start that died taking over
_ATTEMPTS = 100  # turns at the lock: a start waiting for another's takeover sleeps 50 ms a turn


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory, as ``run.lock`` records it."""

    job_id: str = ""  # the Slurm job's array-aware id (squeue's), "" outside Slurm
    restart_count: int = 0
    step_restarts: int = 0  # the job step started again inside the allocation (restart in place)
    host: str = ""  # the machine's hostname: where the pid means something
    node: str = ""  # the Slurm node name (several slurmds may share one host)
    pid: int = 0
    pid_start: str = ""  # "<boot id>:<start time in clock ticks>", "" where /proc cannot say
    since: str = ""
    command: str = ""
    token: str = ""

    @classmethod
    def this_process(cls, command: str) -> Holder:
        job = JobFacts.from_env()
        pid = os.getpid()
        return cls(
            job_id=job.requeue_id,
            restart_count=job.restart_count,
            step_restarts=job.step_restarts,
            host=socket.gethostname(),
            node=job.host(),
            pid=pid,
            pid_start=process_start(pid),
            since=time.strftime("%Y-%m-%dT%H:%M:%S"),
            command=command,
            token=uuid.uuid4().hex,
        )

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or not data.get("token"):
            return None
        known = {f.name for f in fields(cls)}
        try:
            holder = cls(**{k: v for k, v in data.items() if k in known})
            counts = (holder.pid, holder.restart_count, holder.step_restarts)
            return holder if all(isinstance(n, int) for n in counts) else None
        except TypeError:
            return None

    def text(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    def describe(self, why: str = "") -> str:
        """`job 12 (relaytrain train, pid 345 on node1 since ...; WHY)`, or without a job
        `relaytrain train (pid 345 on host since ...; WHY)`."""
        where = f"pid {self.pid} on {self.node or self.host}"
        if self.node and self.host and self.node != self.host:
            where += f" ({self.host})"
        details = f"{where} since {self.since}" + (f"; {why}" if why else "")
        command = self.command or "a run"
        if self.job_id:
            return f"job {self.job_id} ({command}, {details})"
        return f"{command} ({details})"


def process_start(pid: int) -> str:
    """The pid's start identity: this boot's id and its start time (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    fields_after_name = stat.rpartition(")")[2].split()  # the name may contain spaces and parentheses
    return f"{boot}:{fields_after_name[19]}" if len(fields_after_name) > 19 else ""


def process_alive(pid: int, start: str) -> bool:
    """Is the process that recorded (pid, start) still running on this host?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return not start or process_start(pid) in ("", start)


def holder_alive(holder: Holder, me: Holder) -> tuple[bool, str]:
    """(is the holder alive, why) from the point of view of the process ``me``."""
    same_host = holder.host == me.host
    if holder.job_id and holder.job_id == me.job_id:
        if holder.restart_count != me.restart_count:
            return False, f"an earlier run of this job (restart {holder.restart_count})"
        if holder.step_restarts < me.step_restarts:
            # the batch script starts a step again only after the previous one ended
            return False, f"an earlier job step of this run of the job (step restart {holder.step_restarts})"
        if same_host:
            if process_alive(holder.pid, holder.pid_start):
                return True, "another process of this job"
            return False, "its process has ended"
        return True, "another step of this job, on another host"
    if holder.job_id:
        states = queue_states(holder.job_id)
        if states is not None:
            if job_is_over(states):
                return False, f"the job has ended ({states[0] if states else 'gone from the queue'})"
            return True, f"the job is {'/'.join(sorted(set(states)))}"
        if not same_host:
            return True, "Slurm cannot be asked about the job here"
    if same_host:
        if process_alive(holder.pid, holder.pid_start):
            return True, "its process is running"
        return False, "its process has ended"
    return True, "it runs on another host, where its process cannot be checked"


def busy_message(run: RunDir, holder: str, job_id: str = "", lock: bool = True) -> str:
    """The one-line refusal: who holds the run directory and what to do."""
    todo = "wait for it to end"
    if job_id:
        todo += f", stop it with `relaytrain cancel {job_id}`"
    gone = f" (if that holder is surely gone, delete {run.lock})" if lock else ""
    return f"the run directory {run.root}{BUSY_WORDS}{holder}: {todo}, or choose another --run.name{gone}"


def is_busy_refusal(output: str) -> bool:
    """Does a job step's output hold the refusal of a busy run directory?"""
    return "relaytrain: error: the run directory " in output and BUSY_WORDS in output


def _unwritable(run: RunDir, exc: OSError) -> str:
    return f"cannot write the run directory '{run.root}' ({exc.strerror}); set run.dir to a writable path"


class RunLock:
    """The lock of one run directory; ``acquire()`` takes it, ``release()`` gives it back."""

    def __init__(self, run: RunDir):
        self.run = run
        self.path = run.lock
        self.holder: Holder | None = None  # ours, while held

    def read(self) -> tuple[Holder | None, str | None]:
        """(the recorded holder or None when unreadable, the raw text or None when there is no lock)."""
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None, None
        return Holder.parse(raw), raw

    def current_holder(self) -> tuple[Holder | None, bool, str]:
        """(the holder, is it alive, why) as a new start would judge it; (None, False, "") when free."""
        holder, raw = self.read()
        if raw is None:
            return None, False, ""
        alive, why = self._judge(holder, Holder.this_process(""))
        return holder, alive, why

    def acquire(self, command: str) -> RunLock:
        """Take the lock, or raise UserError naming the live holder."""
        me = Holder.this_process(command)
        try:
            self.run.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(_unwritable(self.run, exc)) from None
        took_over = None
        for _ in range(_ATTEMPTS):
            if self._create(me):
                self.holder = me
                atexit.register(self.release)  # an exit before the holder's own release (an exception)
                if took_over:
                    log.warning("taking over %s from %s", self.path, took_over)
                return self
            holder, raw = self.read()
            if raw is None:
                continue  # released in between
            alive, why = self._judge(holder, me)
            text = holder.describe(why) if holder is not None else f"an unreadable lock ({why})"
            if alive:
                raise UserError(busy_message(self.run, text, holder.job_id if holder else ""))
            if self._remove_stale(raw):
                took_over = text
        raise UserError(
            f"could not take {self.path}: other starts keep taking it; start one run per run directory"
        )

    def _judge(self, holder: Holder | None, me: Holder) -> tuple[bool, str]:
        if holder is None:  # written by a start that is still writing it, or damaged
            return (False, "unreadable for a while") if self._old() else (True, "being written")
        if (holder.host, holder.pid, holder.pid_start) == (me.host, me.pid, me.pid_start):
            return False, "held by this process"
        return holder_alive(holder, me)

    def release(self) -> None:
        """Remove the lock if it is still ours (a takeover by a later start leaves theirs alone)."""
        if self.holder is None:
            return
        holder, _ = self.read()
        if holder is not None and holder.token == self.holder.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.holder = None
        atexit.unregister(self.release)

    # -- atomic file operations -----------------------------------------------------------------

    def _create(self, me: Holder) -> bool:
        """Create run.lock with our record; False when it exists."""
        try:
            return _create_with(self.path, me.text(), f"{me.host}.{me.pid}.{me.token[:8]}")
        except OSError as exc:
            raise UserError(_unwritable(self.run, exc)) from None

    def _remove_stale(self, stale_text: str) -> bool:
        """Remove run.lock if it still holds ``stale_text``. Removers take turns through a guard file,
        so the check and the removal are one step for them; a creator cannot replace an existing
        lock, so a lock another start took meanwhile (another token) is never removed."""
        guard = self.run.lock_takeover
        try:
            mine = _create_with(guard, f"{socket.gethostname()} {os.getpid()}\n", uuid.uuid4().hex[:8])
        except OSError as exc:
            raise UserError(_unwritable(self.run, exc)) from None
        if not mine:
            with contextlib.suppress(OSError):
                if time.time() - guard.stat().st_mtime > TAKEOVER_GRACE_S:
                    guard.unlink()  # its owner died within the few milliseconds of a takeover
            time.sleep(0.05)
            return False
        try:
            _, raw = self.read()
            if raw != stale_text:
                return False
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return True
        finally:
            with contextlib.suppress(OSError):
                guard.unlink()

    def _old(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > UNREADABLE_GRACE_S
        except FileNotFoundError:
            return True


def _create_with(path: Path, text: str, tag: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists, atomically on NFS and Lustre: a private file
    hard-linked to the name (O_CREAT|O_EXCL where the filesystem has no hard links)."""
    tmp = path.with_name(f".{path.name}.{tag}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            # NFS: a retransmitted link whose first reply was lost says EEXIST although it worked.
            return os.stat(tmp).st_nlink == 2
        except OSError:
            pass  # no hard links here
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True


def take_run_lock(run: RunDir, rank: int, device, command: str) -> RunLock:
    """Rank 0 of the trainer takes the run directory's lock (and refuses a directory holding another
    program's run, relaytrain.resilience.run_kind) (other ranks get an unheld one); every rank learns whether
    it could. Call it on every rank at the same point, after the process group is up.

    A refusal ends every rank: rank 0 raises the UserError (one line, exit 2), the others exit 2
    quietly instead of waiting in their first collective.
    """
    lock, error = RunLock(run), None
    if rank == 0:
        try:
            lock.acquire(command)
            claim_kind(run, RunKind(TRAIN))  # the trainer's: never a program's run directory
        except Exception as exc:  # any failure must reach the other ranks, or they wait in the broadcast
            lock.release()
            error = exc
    if _agree_failed(error is not None, device):
        if error is not None:
            raise error
        raise SystemExit(USAGE_EXIT_CODE)
    return lock


def _agree_failed(failed: bool, device) -> bool:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
