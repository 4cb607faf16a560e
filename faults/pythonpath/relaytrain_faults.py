"""Faults injected into a relaytrain training process from outside its code (the loop has no fault hooks).

``sitecustomize.py`` beside this file imports it at interpreter start when a ``RELAYTRAIN_FAULT_*``
variable is set. When the process then imports ``relaytrain.trainer``, the Trainer's constructor is
wrapped, and each Trainer it builds gets its faults on public seams of its own objects (its model, its
loader, and its supervision front's watchdog):

- ``RELAYTRAIN_FAULT_NAN_AT_STEPS="5,6"``: ``model.train_step`` returns a NaN loss when it computes one
  of those steps (``state.step + 1``, the step logged in metrics), on one rank
  (``RELAYTRAIN_FAULT_NAN_RANK``, default the last rank), each listed step once per process, so a
  rollback replays it cleanly. The NaN guard must see it, as it would see a real one.
- ``RELAYTRAIN_FAULT_STEP_DELAY_S=0.4``: every rank sleeps this long after each finished step (after
  the first ``supervision.watchdog.beat(step)`` that follows a ``train_step``), so that a tiny model's run
  lasts long enough for a real scheduler to signal, preempt or kill it mid-training without using CPU.
- ``RELAYTRAIN_FAULT_LAYER_DELAY_S=2.5``: every rank sleeps this long before each transformer layer's
  forward in training (a forward pre-hook on each layer of the model's parts; not in an evaluation, which
  runs without gradients), in every job step: a step as long as a wide model's, inside the forward rather
  than after it, while the layers' progress marks keep coming (one after each layer).
- ``RELAYTRAIN_FAULT_SHAPE_ERROR_AT_STEP=N``: every rank's ``model.train_step`` of step N multiplies two
  matrices whose shapes do not fit, a real ``RuntimeError`` from torch, in every process (a restarted or
  requeued run meets it again at the same step, as it would a bug in the model code or a bad config).
- ``RELAYTRAIN_FAULT_IMPORT_MODULE=name``: importing ``relaytrain.trainer`` first imports the module
  ``name`` (a module that is missing or broken on PYTHONPATH fails the start-up of every process with
  its real ImportError, as a user's plugin would).
- ``RELAYTRAIN_FAULT_BREAK_SURVIVORS=1``: a survivor's in-process recovery (``resilience.survivors``)
  fails as it joins the new round (``survivors.join_round`` raises a ``RuntimeError``), on every rank:
  the run must fall back to the restart of every process.
- The hang faults (``HangFaults`` below: a FIFO read, a stalled loader, a skipped collective, a
  slow rank) on one rank (``RELAYTRAIN_FAULT_RANK``) at one step.
- ``RELAYTRAIN_FAULT_STOP_IN_PHASE=rendezvous``: the rank (``RELAYTRAIN_FAULT_RANK``, default the last)
  stops itself with SIGSTOP as its progress board first publishes the phase of that label (a start-up
  phase such as ``rendezvous`` or ``checkpoint load``, before any Trainer exists): a process stopped as
  one stopped from outside is, once per process, in the first job step only, or in the job step
  ``RELAYTRAIN_FAULT_STOP_IN_JOB_STEP`` (1: the first restart in place) instead.

Each fault that lands says so on stderr (a line starting with ``LANDED``, ending with the Unix time it
landed at, ``[t=1764212345.123]``), once per NaN and once per process for the others: a test checks that
line before it judges what the guard or the run did, so a fault that silently stopped landing fails as
that, not as a puzzling pass or failure elsewhere.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import threading
import time

NAN_AT_STEPS_ENV = "RELAYTRAIN_FAULT_NAN_AT_STEPS"
NAN_RANK_ENV = "RELAYTRAIN_FAULT_NAN_RANK"
STEP_DELAY_ENV = "RELAYTRAIN_FAULT_STEP_DELAY_S"
LAYER_DELAY_ENV = "RELAYTRAIN_FAULT_LAYER_DELAY_S"
SHAPE_ERROR_AT_STEP_ENV = "RELAYTRAIN_FAULT_SHAPE_ERROR_AT_STEP"
IMPORT_MODULE_ENV = "RELAYTRAIN_FAULT_IMPORT_MODULE"
BREAK_SURVIVORS_ENV = "RELAYTRAIN_FAULT_BREAK_SURVIVORS"
# seconds a checkpoint file's failed write holds its error before raising it: an async save that filled
# the disk is reported only after the loop has written its next records (onto the full disk)
SAVE_ERROR_DELAY_ENV = "RELAYTRAIN_FAULT_SAVE_ERROR_DELAY_S"
ENV_PREFIX = "RELAYTRAIN_FAULT_"
LANDED = "relaytrain-faults: landed:"
TARGET = "relaytrain.trainer"
# The hang faults: which rank, and what it does at which step
FAULT_RANK_ENV = "RELAYTRAIN_FAULT_RANK"
FIFO_AT_STEP_ENV = "RELAYTRAIN_FAULT_FIFO_AT_STEP"
STALL_AT_STEP_ENV = "RELAYTRAIN_FAULT_STALL_AT_STEP"
SKIP_COLLECTIVE_AT_STEP_ENV = "RELAYTRAIN_FAULT_SKIP_COLLECTIVE_AT_STEP"
SLOW_FACTOR_ENV = "RELAYTRAIN_FAULT_SLOW_FACTOR"
SLOW_FROM_STEP_ENV = "RELAYTRAIN_FAULT_SLOW_FROM_STEP"
STOP_IN_PHASE_ENV = "RELAYTRAIN_FAULT_STOP_IN_PHASE"
# the job step (its restart in place: 0 the first) whose rank stops in that phase (default 0)
STOP_IN_JOB_STEP_ENV = "RELAYTRAIN_FAULT_STOP_IN_JOB_STEP"
HANG_KNOWN = (
    STOP_IN_PHASE_ENV,
    STOP_IN_JOB_STEP_ENV,
    FAULT_RANK_ENV,
    FIFO_AT_STEP_ENV,
    STALL_AT_STEP_ENV,
    SKIP_COLLECTIVE_AT_STEP_ENV,
    SLOW_FACTOR_ENV,
    SLOW_FROM_STEP_ENV,
)
# relaytrain.job.facts.STEP_RESTARTS_ENV (not imported: this module loads before relaytrain): the job driver
# numbers the job steps it starts again inside the allocation. A restarted step runs new processes, so
# "once per process" alone would hang it again at the same step; the hang faults land in the first only.
STEP_RESTARTS_ENV = "RELAYTRAIN_STEP_RESTARTS"


def say(text: str) -> None:
    """The landed line, flushed before whatever the fault does next (a hang fault blocks right after).
    One write, newline included: under PYTHONUNBUFFERED, print() writes its text and its end apart, and
    another rank's line on the same pipe can land between them."""
    sys.stderr.write(f"{LANDED} {text} [t={time.time():.3f}]\n")
    sys.stderr.flush()


def number(name: str, text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise SystemExit(f"relaytrain-faults: {name}={text!r} is not a valid {kind.__name__}") from None


class Faults:
    """The faults asked for by the environment, for one process."""

    def __init__(self, env=os.environ):
        known = (NAN_AT_STEPS_ENV, NAN_RANK_ENV, STEP_DELAY_ENV, LAYER_DELAY_ENV, SHAPE_ERROR_AT_STEP_ENV,
                 IMPORT_MODULE_ENV, BREAK_SURVIVORS_ENV, SAVE_ERROR_DELAY_ENV, *HANG_KNOWN)  # fmt: skip
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:  # a misspelt fault would otherwise arm nothing, and a test would pass without it
            raise SystemExit(f"relaytrain-faults: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        steps = env.get(NAN_AT_STEPS_ENV, "")
        self.nan_steps = {number(NAN_AT_STEPS_ENV, s.strip(), int) for s in steps.split(",") if s.strip()}
        self.hang = HangFaults(env)
        rank = env.get(NAN_RANK_ENV, "").strip()
        # None: the last rank (RELAYTRAIN_FAULT_RANK, when set, names it for every fault)
        self.nan_rank = number(NAN_RANK_ENV, rank, int) if rank else self.hang.rank
        delay = env.get(STEP_DELAY_ENV, "").strip()
        self.step_delay_s = number(STEP_DELAY_ENV, delay, float) if delay else 0.0
        layer = env.get(LAYER_DELAY_ENV, "").strip()
        self.layer_delay_s = number(LAYER_DELAY_ENV, layer, float) if layer else 0.0
        shape = env.get(SHAPE_ERROR_AT_STEP_ENV, "").strip()
        self.shape_error_at = number(SHAPE_ERROR_AT_STEP_ENV, shape, int) if shape else None
        self.import_module = env.get(IMPORT_MODULE_ENV, "").strip()
        self.break_survivors = env.get(BREAK_SURVIVORS_ENV, "").strip() == "1"
        held = env.get(SAVE_ERROR_DELAY_ENV, "").strip()
        self.save_error_delay_s = number(SAVE_ERROR_DELAY_ENV, held, float) if held else 0.0

    def attach(self, trainer) -> None:
        """Wrap this trainer's ``model.train_step`` and ``supervision.watchdog.beat`` (instance attributes
        only)."""
        train_step, beat = trainer.model.train_step, trainer.supervision.watchdog.beat
        rank, world_size = trainer.env.rank, trainer.env.world_size
        nan_rank = world_size - 1 if self.nan_rank is None else self.nan_rank
        nan_steps = set(self.nan_steps) if rank == nan_rank else set()
        delay = self.step_delay_s
        step_open = [False]  # a train_step ran and no beat has ended its step yet
        delay_said = [False]

        @functools.wraps(train_step)
        def faulty_train_step(*args, **kwargs):
            if trainer.state.step + 1 == self.shape_error_at:
                import torch

                say(f"shape error at step {self.shape_error_at} on rank {rank}")
                torch.zeros(4, 64) @ torch.zeros(32, 64)  # RuntimeError: shapes cannot be multiplied
            loss = train_step(*args, **kwargs)
            step_open[0] = True
            step = trainer.state.step + 1
            if step in nan_steps:
                nan_steps.discard(step)  # once per process: the step replayed after a rollback is clean
                say(f"NaN loss at step {step} on rank {rank}")
                return loss * float("nan")
            return loss

        @functools.wraps(beat)
        def slow_beat(step=None):
            beat(step)
            # The first beat with a step after a train_step ends that step; later beats of the same
            # step (after a save) and step-less beats (evaluation, rollback, stop) do not sleep.
            if step is None or not step_open[0]:
                return
            step_open[0] = False
            if not delay_said[0]:
                delay_said[0] = True
                say(f"{delay:g} s step delay after step {step} on rank {rank}")
            time.sleep(delay)

        if self.nan_steps or delay or self.shape_error_at is not None:
            trainer.model.train_step = faulty_train_step
        if delay:
            trainer.supervision.watchdog.beat = slow_beat
        if self.break_survivors:
            trainer.survivors.join_round = _broken_join_round
        if self.layer_delay_s:
            self._delay_layers(trainer, rank)
        if self.save_error_delay_s:
            self._hold_save_errors(rank)
        self.hang.attach(trainer, say)  # over the delay: a slow rank's step time includes the delay

    def _hold_save_errors(self, rank: int) -> None:
        """Each checkpoint file's failed write holds its error ``save_error_delay_s`` before raising it,
        and the loop goes on from a save only once a write failed (or that long passed): its next records
        meet the disk the save filled before the save's failure is known. Says so at the first failure."""
        import threading

        from relaytrain.checkpoint.manager import CheckpointManager
        from relaytrain.checkpoint.storage import RawWriter

        write_file, save, delay = RawWriter._write_file, CheckpointManager.save, self.save_error_delay_s
        failed = threading.Event()

        @functools.wraps(write_file)
        def holding_write_file(*args, **kwargs):
            try:
                return write_file(*args, **kwargs)
            except Exception as exc:
                if not failed.is_set():
                    say(f"a checkpoint write's error ({exc!r}) held {delay:g} s on rank {rank}")
                failed.set()
                time.sleep(delay)
                raise

        @functools.wraps(save)
        def save_then_wait_for_a_failure(*args, **kwargs):
            save(*args, **kwargs)
            failed.wait(delay)

        RawWriter._write_file = holding_write_file
        CheckpointManager.save = save_then_wait_for_a_failure

    def _delay_layers(self, trainer, rank: int) -> None:
        """A forward pre-hook on each transformer layer of the trainer's model parts that sleeps
        ``layer_delay_s`` in a training forward (gradients on); says so at the first."""
        import torch

        delay, said = self.layer_delay_s, [False]

        def sleep_before(_module, _args):
            if not torch.is_grad_enabled():
                return
            if not said[0]:
                said[0] = True
                say(f"{delay:g} s delay before each layer's forward on rank {rank}")
            time.sleep(delay)

        for part in trainer.model.model_parts:
            for layer in part.layers.values():
                layer.register_forward_pre_hook(sleep_before)


def _broken_join_round(lost, _join):
    say(f"survivors' join of round {lost.generation} broken")
    raise RuntimeError("relaytrain-faults: the survivors' join_round is broken on purpose")


class HangFaults:
    """The hang faults, each on one rank (``RELAYTRAIN_FAULT_RANK``, default the last) and once per
    process, in the first job step of a Slurm job only (a restarted step runs clean):

    - ``RELAYTRAIN_FAULT_FIFO_AT_STEP=N``: when the rank is about to compute step N, its data fetch
      (``loader.next_batch``) opens a FIFO that has no writer: ``open()`` blocks in the kernel, as a read
      from a dead mount does (the process cannot run Python meanwhile, its main thread at least).
    - ``RELAYTRAIN_FAULT_STALL_AT_STEP=N``: the data fetch of step N waits forever on an Event, as a
      deadlocked loader does (Python runs; its stack shows the wait).
    - ``RELAYTRAIN_FAULT_SKIP_COLLECTIVE_AT_STEP=N``: the rank skips the all-reduce of the loss it logs
      after step N (``model.reduce_mean`` of ``loss_mean`` returns its own loss), so the ranks' collectives
      no longer pair up: desynchronised. (The stop agreement is not skipped: gloo pairs the skipper's next
      all-reduce on that group with it and fails at once on the size mismatch, a crash, not a hang.)
    - ``RELAYTRAIN_FAULT_SLOW_FACTOR=F`` with ``RELAYTRAIN_FAULT_SLOW_FROM_STEP=N``: from step N, the rank
      sleeps (F - 1) x its own step time after each step (from its data fetch to the ``watchdog.beat`` that
      ends the step, the step delay fault's sleep included), so it runs F times slower but keeps moving.

    Each prints its landed line before it blocks (``say`` flushes).
    """

    def __init__(self, env=os.environ):
        def read(name: str, kind):
            text = env.get(name, "").strip()
            return number(name, text, kind) if text else None

        self.rank = read(FAULT_RANK_ENV, int)  # None: the last rank
        self.fifo_at, self.stall_at = read(FIFO_AT_STEP_ENV, int), read(STALL_AT_STEP_ENV, int)
        self.skip_at = read(SKIP_COLLECTIVE_AT_STEP_ENV, int)
        self.slow_factor, self.slow_from = read(SLOW_FACTOR_ENV, float), read(SLOW_FROM_STEP_ENV, int)
        if (self.slow_factor is None) != (self.slow_from is None):
            raise SystemExit(f"relaytrain-faults: {SLOW_FACTOR_ENV} and {SLOW_FROM_STEP_ENV} go together")
        if self.slow_factor is not None and self.slow_factor <= 1:
            raise SystemExit(f"relaytrain-faults: {SLOW_FACTOR_ENV}={self.slow_factor:g} must be > 1")
        self.first_job_step = env.get(STEP_RESTARTS_ENV, "").strip() in ("", "0")
        self.stop_in_phase = env.get(STOP_IN_PHASE_ENV, "").strip()
        job_step = read(STOP_IN_JOB_STEP_ENV, int) or 0
        self.stop_job_step = job_step == int(env.get(STEP_RESTARTS_ENV, "").strip() or 0)

    def stop_in_phase_of(self, progress, say) -> None:
        """Wrap the progress board's write (module ``progress``, relaytrain.job.progress) so that the faulted
        rank stops itself right after it published the phase labelled ``stop_in_phase``."""
        label, world = self.stop_in_phase, int(os.environ.get("WORLD_SIZE", "1") or 1)
        target = world - 1 if self.rank is None else self.rank
        if not label or not self.stop_job_step:
            return
        if label not in {p.label for p in progress.Phase}:
            raise SystemExit(f"relaytrain-faults: {STOP_IN_PHASE_ENV}={label!r} names no phase")
        write, stopped = progress.ProgressBoard._write_locked, [False]

        @functools.wraps(write)
        def write_then_stop(board, now, whole=True):
            write(board, now, whole)
            if board.rank == target and board.phase_now.label == label and not stopped[0]:
                stopped[0] = True
                say(f"SIGSTOP in {label} on rank {board.rank}")
                os.kill(os.getpid(), signal.SIGSTOP)

        progress.ProgressBoard._write_locked = write_then_stop

    def attach(self, trainer, say) -> None:
        """Wrap this trainer's ``loader.next_batch``, ``model.reduce_mean`` and
        ``supervision.watchdog.beat`` (its instance attributes) on the faulted rank, for the faults asked
        for."""
        rank = trainer.env.rank
        target = trainer.env.world_size - 1 if self.rank is None else self.rank
        if rank != target or not self.first_job_step:
            return
        state, loader, watchdog = trainer.state, trainer.loader, trainer.supervision.watchdog
        blocking = {"fifo": self.fifo_at, "stall": self.stall_at}
        step_started = [None]  # when the rank's current step began (its data fetch); None: no step open
        next_batch = loader.next_batch

        @functools.wraps(next_batch)
        def faulty_next_batch(*args):  # the trainer passes the step
            step_started[0] = time.monotonic()
            step = state.step + 1
            if blocking["fifo"] == step:
                blocking["fifo"] = None
                folder = tempfile.mkdtemp(prefix="relaytrain-fault-")
                fifo = os.path.join(folder, "dead-mount")
                os.mkfifo(fifo)
                say(f"FIFO read with no writer at step {step} on rank {rank}: {fifo}")
                with open(fifo, "rb"):  # blocks in the kernel until a writer comes: none will
                    pass
            if blocking["stall"] == step:
                blocking["stall"] = None
                say(f"data loader stall at step {step} on rank {rank}")
                threading.Event().wait()  # nothing sets it
            return next_batch(*args)

        if self.fifo_at is not None or self.stall_at is not None or self.slow_factor is not None:
            loader.next_batch = faulty_next_batch
        if self.skip_at is not None:
            trainer.model.reduce_mean = self._skipping(trainer.model.reduce_mean, state, rank, say)
        if self.slow_factor is not None:
            watchdog.beat = self._slowing(watchdog.beat, step_started, rank, say)

    def _skipping(self, reduce_mean, state, rank: int, say):
        skip = [self.skip_at]

        @functools.wraps(reduce_mean)
        def skipping_reduce_mean(value, board=None, name="mean"):
            if name != "loss_mean" or state.step != skip[0]:
                return reduce_mean(value, board, name)
            skip[0] = None
            say(f"skipped the loss_mean collective at step {state.step} on rank {rank}")
            return float(value)  # its own loss, not the mean; the other ranks wait in the all-reduce

        return skipping_reduce_mean

    def _slowing(self, beat, step_started: list, rank: int, say):
        factor, first = self.slow_factor, self.slow_from
        said = [False]

        @functools.wraps(beat)
        def slowing_beat(step=None):
            beat(step)
            # The first beat with a step after a data fetch ends that step; later beats of the same step
            # (after a save) and step-less beats (evaluation, rollback, stop) do not sleep.
            started, step_started[0] = step_started[0], None
            if step is None or started is None or step < first:
                return
            took = time.monotonic() - started
            if not said[0]:
                said[0] = True
                say(f"{factor:g}x slower steps from step {step} on rank {rank} (its step took {took:.3f} s)")
            time.sleep((factor - 1) * took)

        return slowing_beat


def _patch_trainer(module, faults: Faults) -> None:
    init = module.Trainer.__init__

    @functools.wraps(init)
    def init_with_faults(self, *args, **kwargs):
        init(self, *args, **kwargs)
        faults.attach(self)

    module.Trainer.__init__ = init_with_faults


class _AfterImport:
    """A one-shot meta path finder: lets the normal finders load ``TARGET``, then patches the module."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            if self.faults.import_module:
                import importlib

                say(f"importing {self.faults.import_module} with {TARGET}")
                importlib.import_module(self.faults.import_module)  # its ImportError ends the start-up
            exec_module(module)
            _patch_trainer(module, self.faults)
            self.faults.hang.stop_in_phase_of(sys.modules["relaytrain.job.progress"], say)

        spec.loader.exec_module = exec_then_patch  # this module's own loader object
        return spec


def install(env=os.environ) -> bool:
    """Arm the faults the environment asks for; False (and nothing armed) when it asks for none."""
    if not any(key.startswith(ENV_PREFIX) and value for key, value in env.items()):
        return False
    faults = Faults(env)  # a malformed value stops the process now, before any training
    if TARGET in sys.modules:
        _patch_trainer(sys.modules[TARGET], faults)
        faults.hang.stop_in_phase_of(sys.modules["relaytrain.job.progress"], say)
    else:
        sys.meta_path.insert(0, _AfterImport(faults))
    return True
