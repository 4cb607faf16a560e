"""The training loop: one code path for a laptop CPU, torchrun on one node and srun on many.

Every step: read this rank's share of the global batch, forward+backward over micro batches (or the
pipeline schedule), clip, check for NaN, update, then let all ranks agree whether to stop. Saving,
stopping and requeueing are decided collectively so that every rank acts at the same step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict

import torch

from relaytrain.checkpoint import (
    Persistence,
    RngState,
    RunRecord,
    TrainingState,
    TrainState,
    UnloadableCheckpoints,
)
from relaytrain.config import Config, config_hash, config_to_toml
from relaytrain.config.run_dir import prepare_run_dir
from relaytrain.data import SampleRecorder, build_train_loader, build_val_loader, to_device
from relaytrain.errors import UserError
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.machine import process_start_time
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.model import flops_per_token
from relaytrain.monitor import MetricsLogger, StepProfiler, StepTimer, window_memory_stats
from relaytrain.monitor.logs import setup_logging
from relaytrain.monitor.time_ledger import LedgerWindows
from relaytrain.optim import build_optimizer, lr_at, schedule_fit_warning, set_lr
from relaytrain.parallel import parallelize
from relaytrain.parallel.distributed import DistEnv, init_distributed, rank0_token, shutdown_distributed
from relaytrain.parallel.layout import validate_layout
from relaytrain.parallel.resize import resize_fields
from relaytrain.preflight.run import check_in_job
from relaytrain.resilience import (
    HangWatchdog,
    NanGuard,
    RunStateFile,
    ShutdownController,
    StackSignal,
    StopReason,
    finished_message,
    handle_stop,
    mark_finished,
    mark_running,
    recorded_checkpoint_step,
    recorded_step,
    stop_fields,
)
from relaytrain.resilience.run_lock import take_run_lock
from relaytrain.resilience.straggler_watch import StragglerWatch

log = logging.getLogger("relaytrain")


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.run_dir = RunDir.of(cfg.run.dir, cfg.run.name)  # built once, passed to every part
        # Where this rank is, for the node's hang watcher (only in a job step that runs one), and its
        # stacks on the watcher's request. Start-up lasts until this process's first step finished.
        self.progress = ProgressBoard.open_from_env(env.rank, env.local_rank)
        self.stacks = StackSignal.register(self.run_dir.stack_dump(env.rank), self.progress.enabled)
        self._stepped = False
        self.model = parallelize(
            cfg.parallel,
            cfg.model,
            cfg.train,
            env.device,
            env.world_size,
            env.rank,
            env.local_world_size,
            seed=cfg.run.seed,
        )
        if env.is_main:
            log.info("parallel layout: %s", self.model.dims.describe())
        self.optimizers = [build_optimizer(cfg.optim, self.model.model_parts, env.device)]
        dims = self.model.dims
        seq_len, vocab_size, runs_dir = cfg.train.seq_len, cfg.model.vocab_size, cfg.run.dir
        samples = SampleRecorder(self.run_dir, env.rank, rank0_token(), self.model.dp_rank, dims.dp,
                                 env.world_size)  # fmt: skip
        self.loader = build_train_loader(cfg.data, self.model.dp_rank, dims.dp, dims.local_batch_size,
                                         seq_len=seq_len, seed=cfg.run.seed, vocab_size=vocab_size,
                                         runs_dir=runs_dir, recorder=samples)  # fmt: skip
        self.val_loader = None  # built only when the run evaluates
        if cfg.train.eval_every:
            self.val_loader = build_val_loader(cfg.data, self.model.dp_rank, self.model.dp_size,
                                               seq_len=seq_len, vocab_size=vocab_size,
                                               runs_dir=runs_dir)  # fmt: skip
        self.state = TrainState(run_id=uuid.uuid4().hex[:12])
        # Everything a checkpoint or snapshot keeps: a new piece of state is one more component here.
        training = TrainingState(
            self.model.model_parts,
            self.optimizers,
            {"train_state": self.state, "data": self.loader, "rng": RngState(cfg.run.seed)},
        )
        self.persistence = Persistence(
            cfg.checkpoint,
            self.run_dir,
            RunRecord(cfg.run.name, config_to_toml(cfg), config_hash(cfg), cfg.model, cfg.data.tokenizer),
            training,
            rank=env.rank,
            world_size=env.world_size,
            parallel_dims=vars(self.model.dims) | {"nodes": env.num_nodes},
            # run_state.json then knows the run has this checkpoint even if the directory is lost later
            on_commit=RunStateFile(self.run_dir).note_checkpoint,
            on_event=lambda *event, **fields: self.metrics.log_event(*event, **fields),  # logger: below
            board=self.progress,
        )
        self.metrics = MetricsLogger(
            cfg.metrics,
            self.run_dir,
            is_main=env.is_main,
            device=env.device,
            world_size=env.world_size,
            total_steps=cfg.train.max_steps,
            tokens_per_step=cfg.train.global_batch_size * cfg.train.seq_len,
            flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
            run_name=cfg.run.name,
            run_config=asdict(cfg),
        )
        self.controller = ShutdownController(
            cfg.resilience, env.rank, env.device, self.run_dir, board=self.progress
        )
        self.watchdog = HangWatchdog(
            cfg.resilience.hang_timeout_s,
            env.rank,
            self.run_dir.hang_dump(env.rank),
            on_fire=lambda step: self.controller.finish(StopReason.HANG, step),
        )
        self.nan_guard = NanGuard(cfg.resilience, env.device)
        self.profiler = StepProfiler(cfg.metrics, self.run_dir, env.rank, env.device)
        self.timer = StepTimer(env.device)
        stages = self.model.dims.pipeline_stages()  # a rank's straggler peers: the ranks of its stage
        self.straggler = StragglerWatch(
            cfg.resilience, env, self.progress, self.metrics, cfg.slurm.min_nodes, stages
        )
        self.straggler.time_forward(self.model.work_modules(), compiled=self.model.compiled)
        self.ledger = LedgerWindows(self.metrics, self.run_dir, self.persistence.spent, process_start_time())

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.stacks.close()
            self.progress.close()  # done: the watcher sees a rank that left, not one that stopped moving

    def _run(self) -> int:
        cfg, state = self.cfg, self.state
        resuming = cfg.checkpoint.resume == "auto"
        done = finished_message(cfg.train.max_steps, self.run_dir) if resuming else None
        if done:
            log.info("%s", done)
            return 0
        fitted = schedule_fit_warning(cfg.optim, cfg.train.max_steps)
        if fitted and self.env.rank == 0:
            log.warning("%s", fitted)
        # Handlers first (a stop during the load is kept); a failed load marks the run failed, not `stopped`.
        self.controller.install()
        finished = False
        try:
            restore_start = time.time()
            resumed = self.persistence.restore(recorded_checkpoint_step(self.run_dir))
            mark_running(cfg.train.max_steps, self.run_dir, self.env.rank, state.step)
            self.metrics.log_event(
                "resume" if resumed is not None else "start",
                state.step,
                world_size=self.env.world_size,
                nodes=self.env.num_nodes,
                **self.ledger.begin(state.step, restore_start, self.persistence.restored_from),
            )
            resize = resize_fields(self.persistence.resumed_layout, self.model.dims, self.env.num_nodes)
            if resumed is not None and resize is not None:
                self.metrics.log_event("resize", state.step, **resize)
            self.watchdog.start()
            self.persistence.save_initial()
            code = self._loop()
            finished = state.step >= cfg.train.max_steps
            return code
        except UnloadableCheckpoints as exc:
            # Failed, not a crash: the job is not requeued into the same refusal. The record keeps the step
            # the run had reached (and its checkpoint_step), so the next attempt still knows what is at stake.
            reached = recorded_step(self.run_dir) or 0
            self.controller.finish(StopReason.DAMAGED_CHECKPOINT, reached, saved=False, message=str(exc))
            raise
        except BaseException as exc:
            user_error = str(exc) if isinstance(exc, UserError) else ""  # the step's end won't retry it
            self.controller.finish(StopReason.ERROR, state.step, message=repr(exc), user_error=user_error)
            raise
        finally:
            # Before the watchdog stops: a pending async save that never commits is still a hang.
            self.persistence.close(finished)  # snapshots deleted once the run is done, else kept
            self.watchdog.stop()
            self.controller.uninstall(exiting=True, finished=finished)
            self.profiler.close()
            self.metrics.close()

    def _loop(self) -> int:
        cfg, state, train = self.cfg, self.state, self.cfg.train
        window_start, window_tokens = time.perf_counter(), 0
        self.profiler.step(state.step)  # a profiling window may start at this job's first step
        tokens_per_step = train.global_batch_size * train.seq_len
        while state.step < train.max_steps:
            step = state.step + 1
            lr = lr_at(cfg.optim, step, train.max_steps) * state.lr_scale
            set_lr(self.optimizers, lr)
            with self._section("data", Phase.DATA), self.straggler.work("data"):
                inputs, targets = (to_device(t, self.env.device) for t in self.loader.next_batch(step))
            with self._section("forward_backward", Phase.FORWARD_BACKWARD):
                loss = self.model.train_step(inputs, targets)
            with self._section("optimizer", Phase.OPTIMIZER):
                grad_norm = self.model.clip_grad_norm_(train.grad_clip)
                # One collective and one host read a step: all ranks' stop reasons and NaN flags together
                reason, bad = self.controller.agree_with(
                    step, self.persistence.save_seconds_estimate(), self.nan_guard.flag(loss, grad_norm)
                )
                verdict = self.nan_guard.decide(bad)
                self.persistence.before_optimizer_step()  # a snapshot's copies still running go first
                with self.straggler.work("optimizer"):  # the update alone: no collective inside
                    for opt in self.optimizers if verdict == "ok" else ():
                        opt.step()
                    for opt in self.optimizers:
                        opt.zero_grad(set_to_none=True)
            if verdict == "stop":
                return self._stop(StopReason.NAN, step - 1)
            if verdict == "rollback":
                self._rollback()
                continue
            state.step = step
            state.tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            self.watchdog.beat(step)
            # Counted per step: every collective on the board, log/eval/save steps' extra ones too (loss_mean,
            # checkpoint_*). The usual count is the mode over recent steps, which those rarer steps leave at
            # the every-step count (stop_agreement); only the step after one shows a higher last count.
            self.progress.step_done(step)
            self._stepped = True
            self.straggler.step_done(step)  # every straggler_every steps: one all-gather of work times
            self.profiler.step(step)
            # Step 1 too: the loss curve starts at the initial loss, not log_every steps into it.
            if step % cfg.metrics.log_every == 0 or step in (1, train.max_steps):
                self.timer.synchronize()  # loss and norms are read at log steps only, after one wait
                elapsed = time.perf_counter() - window_start
                self._log_train(step, loss, grad_norm, lr, window_tokens, elapsed)
                window_start, window_tokens = time.perf_counter(), 0
            slow = self.val_loader is not None and (step % train.eval_every == 0 or step == train.max_steps)
            if slow:
                eval_start = time.perf_counter()
                with self.timer.excluded():
                    self._evaluate(step)
                window_start += time.perf_counter() - eval_start  # tokens/s counts training time only
                self.ledger.add_eval(time.perf_counter() - eval_start)
            with self.timer.section("checkpoint"):
                if self.persistence.after_step(step, step == train.max_steps):
                    self.watchdog.beat(step)  # a save is progress: the hang timeout is per unit of work
                    slow = True
            if slow:  # a stop signalled during this evaluation or save is agreed now, not a step later
                reason = max(reason, self.controller.agree(step, self.persistence.save_seconds_estimate()))
            if reason == StopReason.NONE and step == train.stop_at_step < train.max_steps:
                reason = StopReason.STOP_AT_STEP
            if (
                reason == StopReason.NONE
                and step < train.max_steps
                and self.straggler.stop_due(step, self.persistence)
            ):
                reason = StopReason.STRAGGLER  # every rank: the same verdict from the same gathered times
            if self.ledger.due(step, cfg.metrics.log_every):
                self.ledger.close_window(step)
            if reason != StopReason.NONE:
                return self._stop(reason, step)
        self.ledger.close_window(state.step)
        self.persistence.wait()
        mark_finished(self.run_dir, self.env.rank, state.step)
        self.metrics.log_event("finished", state.step)
        return 0

    def _stop(self, reason: StopReason, step: int) -> int:
        """Save where every rank agreed to stop, then hand the decision to requeue to the marker file."""
        log.info("stopping at step %d: %s", step, reason.name.lower())
        self.ledger.close_window(step)  # the save and the exit that follow are the stop's
        self.progress.phase(Phase.STOP)
        straggler = self.straggler.verdict if reason == StopReason.STRAGGLER else None
        if reason != StopReason.NAN:
            self.controller.start_hard_deadline()
            self.watchdog.beat()
            if straggler is None or not self.persistence.saves_by_itself:
                self.persistence.save_now(step, reason.name.lower())
            self.persistence.wait()  # a straggler's stop follows a snapshot or checkpoint just taken
        self.metrics.log_event("stop", step, **stop_fields(reason, self.cfg.checkpoint))
        return self.controller.finish(reason, step, facts={"straggler": straggler} if straggler else None)

    def _rollback(self) -> None:
        self.persistence.wait()
        self.watchdog.beat()
        resumed = self.persistence.reload()
        if resumed is None:
            raise UserError(
                "NaN rollback needs a checkpoint but none is complete yet; use resilience.nan_policy"
            )
        self.state.lr_scale *= self.cfg.resilience.nan_rollback_lr_scale
        self.metrics.log_event("rollback", self.state.step, lr_scale=self.state.lr_scale)

    @contextlib.contextmanager
    def _section(self, name: str, phase: Phase) -> Iterator[None]:
        """A timed section of the step, published as its phase from the second step on: the first step
        (compilation, the first allocations) stays start-up, whose limit is the hang cap."""
        if self._stepped:
            self.progress.phase(phase)
        with self.timer.section(name):
            yield

    # -- reporting --------------------------------------------------------------------------------

    def _log_train(self, step, loss, grad_norm, lr, tokens, elapsed) -> None:
        record = {
            "loss": self.model.reduce_mean(loss, self.progress, "loss_mean"),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_seen": self.state.tokens_seen,
        }
        record |= {f"time_{k}_s": v for k, v in self.timer.window().items()}
        record |= {f"snapshot_{k}": v for k, v in self.persistence.last_snapshot.items()}  # the newest's
        # every rank: the log window's peak, max over ranks
        record |= window_memory_stats(self.env.device, board=self.progress)
        self.metrics.log_train(step, record, tokens=tokens, seconds=elapsed)

    @torch.no_grad()
    def _evaluate(self, step: int) -> None:
        train = self.cfg.train
        self.progress.phase(Phase.EVALUATION)
        total, batches = 0.0, 0
        for inputs, targets in self.val_loader.batches(train.eval_steps, self.model.dims.micro_batch_size):
            loss = self.model.eval_loss(inputs.to(self.env.device), targets.to(self.env.device))
            total += self.model.reduce_mean(loss, self.progress, "val_loss_mean")
            batches += 1
            # No early exit on a stop request: this evaluation finishes (bounded by train.eval_steps), so a
            # stopped and resumed run logs the same val_loss curve as one that never stopped.
            self.watchdog.beat()
        if batches:
            val = total / batches
            self.metrics.log_eval(step, {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))})


def check_world(cfg: Config, env: DistEnv, run: RunDir | None) -> None:
    """Refuse a world no layout fits (e.g. `--parallel.tp=2` on one process, a requeue on fewer nodes than
    the global batch divides by). In a Slurm job (`run` given) run_state.json says failed with the
    reason, as an error the user must fix, so the job ends instead of requeueing into the same error."""
    try:
        validate_layout(
            cfg.parallel, cfg.model, cfg.train, env.world_size, env.local_world_size, env.device.type
        )
    except UserError as exc:
        message = f"no valid layout for {env.world_size} rank(s) on {env.num_nodes} node(s): {exc}"
        if run is not None:
            step = recorded_step(run) or 0  # recorded as a user error: the end of the step does not retry it
            handle_stop(
                cfg.resilience, run, StopReason.ERROR, step, env.rank, saved=False, user_error=message
            )
        raise UserError(message) from None


def train(cfg: Config) -> int:
    """Run (or continue) the configured training job; returns the process exit code."""
    env = init_distributed(cfg)
    if not JobFacts.from_env().in_slurm:
        # No batch shell reads run_state.json: an impossible layout is a usage error like a config
        # mistake, one line and exit 2 before the run directory is touched.
        try:
            check_world(cfg, env, None)
        except UserError:
            shutdown_distributed()
            raise
    # One writer per run directory: rank 0 takes its lock before anything is written into it.
    lock = take_run_lock(RunDir.of(cfg.run.dir, cfg.run.name), env.rank, env.device, "relaytrain train")
    run = prepare_run_dir(cfg, env.is_main)
    try:
        setup_logging(run, env.rank, env.local_rank, env.node, cfg.metrics.rank_logs)
    except OSError as exc:
        why = f"cannot write logs under '{run.root}' ({exc.strerror}); set run.dir to a writable path"
        raise UserError(why) from None
    torch.manual_seed(cfg.run.seed)
    try:
        check_world(cfg, env, run)
        check_in_job(cfg, env)  # resilience.preflight: each node measured first (docs/howto/preflight.md)
        return Trainer(cfg, env).run()
    finally:
        lock.release()
        shutdown_distributed()
