"""The training loop: one code path for a laptop CPU, torchrun on one node and srun on many.

Every step: read this rank's share of the global batch, forward+backward over micro batches (or the
pipeline schedule), clip, check for NaN, update, then let all ranks agree whether to stop. Saving,
stopping and requeueing are decided collectively so that every rank acts at the same step.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import uuid
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
from relaytrain.job import JobFacts, RunDir, startup
from relaytrain.job.machine import process_start_time
from relaytrain.job.progress import Phase
from relaytrain.model import flops_per_token
from relaytrain.monitor import MetricsLogger, StepProfiler, StepTimer, window_memory_stats
from relaytrain.monitor.logs import setup_logging
from relaytrain.monitor.time_ledger import LedgerWindows
from relaytrain.optim import build_optimizer, lr_at, schedule_fit_warning, set_lr
from relaytrain.parallel import parallelize
from relaytrain.parallel.compile_cache import CompileCache
from relaytrain.parallel.distributed import (
    DistEnv,
    init_distributed,
    rank0_token,
    rejoin_distributed,
    shutdown_distributed,
)
from relaytrain.parallel.layout import validate_layout
from relaytrain.parallel.resize import resize_fields
from relaytrain.preflight.run import check_in_job
from relaytrain.resilience import (
    RunStateFile,
    StopReason,
    Supervision,
    finished_message,
    handle_stop,
    mark_finished,
    mark_running,
    recorded_checkpoint_step,
    recorded_step,
)
from relaytrain.resilience.rank.survivors import RankLost, Survivors
from relaytrain.resilience.run_lock import take_run_lock

log = logging.getLogger("relaytrain")


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, survivors: Survivors | None = None):
        self.cfg, self.env = cfg, env
        self.survivors = survivors or Survivors(cfg.resilience, {})  # off unless train() built one
        self.run_dir = RunDir.of(cfg.run.dir, cfg.run.name)  # built once, passed to every part
        # The board, the step clock and the stack signal first: the hang watcher sees the model's build
        self.supervision = Supervision(cfg, env, self.run_dir)
        self.clock = self.supervision.clock  # the loop enters each section of a step on it once
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
        self.loader, self.val_loader = self._loaders()
        self.state = TrainState(run_id=uuid.uuid4().hex[:12])
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
        # The stop agreement, the NaN guard, the watchdog, the straggler watch
        self.supervision.watch(
            self.metrics,
            self.model.work_modules(),
            parts=self.model.model_parts,
            compiled=self.model.compiled,
            tensor_parallel=self.model.dims.tp > 1,
            stages=self.model.dims.pipeline_stages(),  # a rank's straggler peers: the ranks of its stage
        )
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
            on_event=self.metrics.log_event,
            clock=self.clock,
        )
        if self.model.compiled:  # loaded before the first compile; written after a step that compiled
            self.clock.add_reader(CompileCache.open(self.run_dir, env.rank, self.metrics.log_event))
        self.profiler = StepProfiler(cfg.metrics, self.run_dir, env.rank, env.device)
        self.timer = StepTimer(env.device)  # the metrics' phase times, read from the step clock
        self.clock.add_reader(self.timer)
        slowdown = self.persistence.snapshot_slowdown_s
        self.ledger = LedgerWindows(self.metrics, self.run_dir, self.clock, slowdown, process_start_time())

    def _loaders(self):
        """This rank's share of the training data, and the validation data when the run evaluates."""
        cfg, env, dims = self.cfg, self.env, self.model.dims
        seq_len, vocab_size, runs_dir = cfg.train.seq_len, cfg.model.vocab_size, cfg.run.dir
        samples = SampleRecorder(
            self.run_dir, env.rank, rank0_token(), self.model.dp_rank, dims.dp, env.world_size
        )
        loader = build_train_loader(
            cfg.data,
            self.model.dp_rank,
            dims.dp,
            dims.local_batch_size,
            seq_len=seq_len,
            seed=cfg.run.seed,
            vocab_size=vocab_size,
            runs_dir=runs_dir,
            recorder=samples,
        )
        if not cfg.train.eval_every:
            return loader, None
        return loader, build_val_loader(
            cfg.data,
            self.model.dp_rank,
            self.model.dp_size,
            seq_len=seq_len,
            vocab_size=vocab_size,
            runs_dir=runs_dir,
        )

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.supervision.leave()

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
        self.supervision.starting()
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
            self.survivors.restored(state.step, time.time() - restore_start, self.env.device)
            resize = resize_fields(self.persistence.resumed_layout, self.model.dims, self.env.num_nodes)
            if resumed is not None and resize is not None:
                self.metrics.log_event("resize", state.step, **resize)
            self.supervision.running()
            self.persistence.save_initial()
            code = self._loop()
            finished = state.step >= cfg.train.max_steps
            return code
        except UnloadableCheckpoints as exc:
            # Failed, not a crash (no requeue into the same refusal); the record keeps the step reached.
            reached = recorded_step(self.run_dir) or 0
            self.supervision.record(StopReason.DAMAGED_CHECKPOINT, reached, saved=False, message=str(exc))
            raise
        except BaseException as exc:
            lost = self.survivors.caught(exc, state.step)  # another rank died: this one stays (no record)
            if lost is not None:
                raise lost from exc
            error = self.persistence.disk_full_failure(exc, state.step) or exc  # a save settled first
            user_error = str(error) if isinstance(error, UserError) else ""  # the step's end won't retry it
            self.supervision.record(StopReason.ERROR, state.step, message=repr(error), user_error=user_error)
            if error is not exc:
                raise error from exc
            raise
        finally:
            # Before the watchdog stops: a pending async save that never commits is still a hang.
            self.persistence.close(finished)  # snapshots deleted once the run is done, else kept
            self.supervision.close(finished)
            self.profiler.close()
            self.metrics.close()

    def _loop(self) -> int:
        cfg, state, train, clock = self.cfg, self.state, self.cfg.train, self.clock
        self.profiler.step(state.step)  # a profiling window may start at this job's first step
        tokens_per_step, window_tokens = train.global_batch_size * train.seq_len, 0
        while state.step < train.max_steps:
            step = state.step + 1
            lr = lr_at(cfg.optim, step, train.max_steps) * state.lr_scale
            set_lr(self.optimizers, lr)
            with clock.section(Phase.DATA, alone=True):
                inputs, targets = (to_device(t, self.env.device) for t in self.loader.next_batch(step))
            with clock.section(Phase.FORWARD_BACKWARD):
                loss = self.model.train_step(inputs, targets)
            with clock.section(Phase.OPTIMIZER):
                grad_norm = self.model.clip_grad_norm_(train.grad_clip)
                # One collective and one host read a step: all ranks' stop reasons and NaN flags together
                reason, verdict = self.supervision.agree(
                    step, self.persistence.save_seconds_estimate(), loss, grad_norm
                )
                self.persistence.before_optimizer_step()  # a snapshot's copies still running go first
                with clock.alone():  # the update alone: no collective inside
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
            self.supervision.step_done(step)
            self.survivors.step_done(step, self.metrics.log_event)  # a recovery's event once it is redone
            self.profiler.step(step)
            # Step 1 too: the loss curve starts at the initial loss, not log_every steps into it.
            if step % cfg.metrics.log_every == 0 or step in (1, train.max_steps):
                self.timer.synchronize()  # loss and norms are read at log steps only, after one wait
                self._log_train(step, loss, grad_norm, lr, window_tokens)
                window_tokens = 0
            slow = self.val_loader is not None and (step % train.eval_every == 0 or step == train.max_steps)
            if slow:
                self._evaluate(step)  # its section is left out of the step time and tokens/s
            if self.persistence.after_step(step, step == train.max_steps):
                self.supervision.saved(step)
                slow = True
            reason = self.supervision.agree_after(step, reason, slow, self.persistence)
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
        self.ledger.close_window(step)  # the save and the exit that follow are the stop's
        return self.supervision.stop(reason, step, self.persistence)

    def _rollback(self) -> None:
        self.persistence.wait()
        self.supervision.beat()
        resumed = self.persistence.reload()
        if resumed is None:
            raise UserError(
                "NaN rollback needs a checkpoint but none is complete yet; use resilience.nan_policy"
            )
        self.state.lr_scale *= self.cfg.resilience.nan_rollback_lr_scale
        self.metrics.log_event("rollback", self.state.step, lr_scale=self.state.lr_scale)

    # -- reporting --------------------------------------------------------------------------------

    def _log_train(self, step, loss, grad_norm, lr, tokens) -> None:
        board = self.supervision.board
        record = {
            "loss": self.model.reduce_mean(loss, board, "loss_mean"),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_seen": self.state.tokens_seen,
        }
        record |= {f"time_{k}_s": v for k, v in self.timer.window().items()}
        record |= {f"snapshot_{k}": v for k, v in self.persistence.last_snapshot.items()}  # the newest's
        # every rank: the log window's peak, max over ranks
        record |= window_memory_stats(self.env.device, board=board)
        self.metrics.log_train(step, record, tokens=tokens, seconds=self.timer.wall_s)

    @torch.no_grad()
    def _evaluate(self, step: int) -> None:
        train, board = self.cfg.train, self.supervision.board
        total, batches = 0.0, 0
        with self.clock.section(Phase.EVALUATION):
            for inputs, targets in self.val_loader.batches(
                train.eval_steps, self.model.dims.micro_batch_size
            ):
                loss = self.model.eval_loss(inputs.to(self.env.device), targets.to(self.env.device))
                total += self.model.reduce_mean(loss, board, "val_loss_mean")
                batches += 1
                # No early exit on a stop request: this evaluation finishes (bounded by train.eval_steps), so
                # a stopped and resumed run logs the same val_loss curve as one that never stopped.
                self.supervision.beat()
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
    startup.enter(Phase.RENDEZVOUS)  # on the progress board before the process group exists
    survivors = Survivors(cfg.resilience)
    env = init_distributed(cfg, survivors.replacement_store())
    startup.enter(Phase.STARTUP)
    if not JobFacts.from_env().in_slurm:
        # No batch shell reads run_state.json: an impossible layout is a usage error (exit 2), no run dir.
        try:
            check_world(cfg, env, None)
        except UserError:
            shutdown_distributed()
            raise
    try:
        while True:
            try:
                return _train_in_group(cfg, env, survivors)
            except RankLost as caught:  # resilience.survivors: another rank died, this process stays
                lost = caught.detached()  # its traceback holds the old trainer, its model and groups
            gc.collect()
            survivors.rejoin(lost, lambda store, timeout_s: rejoin_distributed(cfg, env, store, timeout_s))
    finally:
        shutdown_distributed()


def _train_in_group(cfg: Config, env: DistEnv, survivors: Survivors) -> int:
    """Everything after the process group is up: once per group (resilience/rank/survivors.py)."""
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
        # resilience.preflight (docs/howto/preflight.md); exclude: a node named ends the step before training
        stop = check_in_job(cfg, env, run)
        if stop:
            return stop
        return Trainer(cfg, env, survivors).run()
    finally:
        lock.release()
