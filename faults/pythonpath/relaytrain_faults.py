"""Faults injected into a relaytrain training process from outside its code (the loop has no fault hooks).

``sitecustomize.py`` beside this file imports it at interpreter start when a ``RELAYTRAIN_FAULT_*``
variable is set. When the process then imports ``relaytrain.trainer``, the Trainer's constructor is
wrapped, and each Trainer it builds gets its faults on two public seams of its own objects:

- ``RELAYTRAIN_FAULT_NAN_AT_STEPS="5,6"``: ``model.train_step`` returns a NaN loss when it computes one
  of those steps (``state.step + 1``, the step logged in metrics), on one rank
  (``RELAYTRAIN_FAULT_NAN_RANK``, default the last rank), each listed step once per process, so a
  rollback replays it cleanly. The NaN guard must see it, as it would see a real one.
- ``RELAYTRAIN_FAULT_STEP_DELAY_S=0.4``: every rank sleeps this long after each finished step (after the
  first ``watchdog.beat(step)`` that follows a ``train_step``), so that a tiny model's run lasts long
  enough for a real scheduler to signal, preempt or kill it mid-training without using CPU.

Each fault that lands says so on stderr (a line starting with ``LANDED``), once per NaN and once per
process for the delay: a test checks that line before it judges what the guard or the run did, so a
fault that silently stopped landing fails as that, not as a puzzling pass or failure elsewhere.
"""

from __future__ import annotations

import functools
import os
import sys
import time

NAN_AT_STEPS_ENV = "RELAYTRAIN_FAULT_NAN_AT_STEPS"
NAN_RANK_ENV = "RELAYTRAIN_FAULT_NAN_RANK"
STEP_DELAY_ENV = "RELAYTRAIN_FAULT_STEP_DELAY_S"
ENV_PREFIX = "RELAYTRAIN_FAULT_"
LANDED = "relaytrain-faults: landed:"
TARGET = "relaytrain.trainer"


def _say(text: str) -> None:
    print(f"{LANDED} {text}", file=sys.stderr, flush=True)


def _number(name: str, text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise SystemExit(f"relaytrain-faults: {name}={text!r} is not a valid {kind.__name__}") from None


class Faults:
    """The faults asked for by the environment, for one process."""

    def __init__(self, env=os.environ):
        known = (NAN_AT_STEPS_ENV, NAN_RANK_ENV, STEP_DELAY_ENV)
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:  # a misspelt fault would otherwise arm nothing, and a test would pass without it
            raise SystemExit(f"relaytrain-faults: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        steps = env.get(NAN_AT_STEPS_ENV, "")
        self.nan_steps = {_number(NAN_AT_STEPS_ENV, s.strip(), int) for s in steps.split(",") if s.strip()}
        rank = env.get(NAN_RANK_ENV, "").strip()
        self.nan_rank = _number(NAN_RANK_ENV, rank, int) if rank else None  # None: the last rank
        delay = env.get(STEP_DELAY_ENV, "").strip()
        self.step_delay_s = _number(STEP_DELAY_ENV, delay, float) if delay else 0.0

    def attach(self, trainer) -> None:
        """Wrap this trainer's ``model.train_step`` and ``watchdog.beat`` (instance attributes only)."""
        train_step, beat = trainer.model.train_step, trainer.watchdog.beat
        rank, world_size = trainer.env.rank, trainer.env.world_size
        nan_rank = world_size - 1 if self.nan_rank is None else self.nan_rank
        nan_steps = set(self.nan_steps) if rank == nan_rank else set()
        delay = self.step_delay_s
        step_open = [False]  # a train_step ran and no beat has ended its step yet
        delay_said = [False]

        @functools.wraps(train_step)
        def faulty_train_step(*args, **kwargs):
            loss = train_step(*args, **kwargs)
            step_open[0] = True
            step = trainer.state.step + 1
            if step in nan_steps:
                nan_steps.discard(step)  # once per process: the step replayed after a rollback is clean
                _say(f"NaN loss at step {step} on rank {rank}")
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
                _say(f"{delay:g} s step delay after step {step} on rank {rank}")
            time.sleep(delay)

        if self.nan_steps or delay:
            trainer.model.train_step = faulty_train_step
        if delay:
            trainer.watchdog.beat = slow_beat


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
            exec_module(module)
            _patch_trainer(module, self.faults)

        spec.loader.exec_module = exec_then_patch  # this module's own loader object
        return spec


def install(env=os.environ) -> bool:
    """Arm the faults the environment asks for; False (and nothing armed) when it asks for none."""
    if not any(key.startswith(ENV_PREFIX) and value for key, value in env.items()):
        return False
    faults = Faults(env)  # a malformed value stops the process now, before any training
    if TARGET in sys.modules:
        _patch_trainer(sys.modules[TARGET], faults)
    else:
        sys.meta_path.insert(0, _AfterImport(faults))
    return True
