"""Typed config sections. Every key a user may write in TOML is a field here.

Each field's comment is the user-facing documentation (docs/reference/config.md is generated from the
same names). Defaults are the embedded debug run: a tiny model on the bundled corpus, on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from relaytrain.config.domains import (
    MAX_BATCH,
    MAX_NODES,
    MAX_PER_NODE,
    MAX_SECONDS,
    absolute_path,
    at_least,
    catchable_signal,
    env_name,
    env_table,
    in_range,
    minus_one_or_at_least,
    one_of,
    path_name,
    path_without_percent,
    positive,
    seconds,
    setting,
    slurm_time,
    with_lengths,
    zero_or_in_range,
    zero_or_more_or,
)

# What the derived collective timeout adds to the hang monitor's cap: the monitor's own polling, the
# stacks it collects and the kill it asks for all fit in it.
COLLECTIVE_TIMEOUT_MARGIN_S = 120.0


class Section:
    """Base of every section and of Config. `freeze` (load_config runs it after validation) makes every
    assignment fail, so no component changes the validated config it was handed: a value a command derives
    goes into load_config before validation, and a component that needs a variant makes a new section
    with `dataclasses.replace`. Lists and tables inside stay Python lists and dicts: replace them, never
    change them in place."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"config {type(self).__name__}.{name} is read-only after validation; pass the value to "
                "load_config (an override) or derive a new section with dataclasses.replace"
            )
        object.__setattr__(self, name, value)


@dataclass(kw_only=True)
class RunConfig(Section):
    # run directory is <dir>/<name>; the same name resumes the same run
    name: str = setting("debug", path_name())
    dir: str = setting("runs", path_without_percent())  # parent of run directories
    seed: int = setting(0, at_least(0))  # seeds model init, data order and dropout-free RNG streams
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu


@dataclass(kw_only=True)
class ModelConfig(Section):
    preset: str = "debug"  # informational name of the size preset the config came from
    dim: int = setting(256, at_least(1))  # model width (hidden size)
    n_layers: int = setting(4, at_least(1))  # transformer blocks
    n_heads: int = setting(8, at_least(1))  # attention (query) heads; head dim = dim / n_heads
    # grouped-query attention: heads share n_heads // n_kv_heads KV heads
    n_kv_heads: int = setting(4, at_least(1))
    # >= the tokenizer's vocabulary; padded for tensor-parallel splits
    vocab_size: int = setting(320, at_least(1))
    ffn_dim: int = setting(0, at_least(0))  # 0: Llama rule from dim, ffn_dim_multiplier and multiple_of
    ffn_dim_multiplier: float = setting(1.0, in_range(0, 64, lo_open=True))  # Llama rule: scales 8/3 * dim
    multiple_of: int = setting(64, at_least(1))  # Llama rule: the FFN width is rounded up to this
    norm_eps: float = setting(1e-5, in_range(0, 1, lo_open=True))  # RMSNorm epsilon
    rope_theta: float = setting(10000.0, positive())  # RoPE base (Llama 3: 500000)
    max_seq_len: int = setting(2048, at_least(1))  # RoPE table length; must be >= train.seq_len
    tie_embeddings: bool = False  # output projection shares the embedding matrix
    # output projections are scaled by 1/sqrt(2 * n_layers)
    init_std: float = setting(0.02, in_range(0, 1, lo_open=True))


@dataclass(kw_only=True)
class DataConfig(Section):
    # Prepared dataset directories (from `relaytrain prepare-data`). Empty: the bundled corpus,
    # tokenized on first use with the byte tokenizer into <run.dir>/.cache.
    sources: list[str] = field(default_factory=list)
    weights: list[float] = setting(domain=positive(), factory=list)  # mixture weights; empty: equal
    tokenizer: str = "byte"  # "byte" or a local tokenizer.json; must match the prepared data
    shuffle: bool = True  # read the windows of each source in a seeded random order (false: file order)
    # true: train anyway when model.vocab_size > 2 x the tokenizer's ids + 1024, or when the planned
    # tokens (max_steps x global_batch_size x seq_len) read the data more than 100 times (a toy run)
    allow_small: bool = False


@dataclass(kw_only=True)
class TrainConfig(Section):
    max_steps: int = setting(200, at_least(1))  # the LR schedule spans this many optimizer steps
    # sequences per optimizer step, over all data-parallel ranks
    global_batch_size: int = setting(16, in_range(1, MAX_BATCH))
    micro_batch_size: int = setting(4, in_range(1, MAX_BATCH))  # sequences per forward/backward on one rank
    seq_len: int = setting(128, at_least(1))  # tokens per training sequence (<= model.max_seq_len)
    grad_clip: float = setting(1.0, at_least(0))  # max global grad norm; 0 disables clipping
    eval_every: int = setting(100, at_least(0))  # 0 disables evaluation
    eval_steps: int = setting(4, at_least(1))  # validation micro-batches per evaluation
    # end this job after that step with a checkpoint (0: run to max_steps)
    stop_at_step: int = setting(0, at_least(0))


@dataclass(kw_only=True)
class OptimConfig(Section):
    lr: float = setting(3e-3, positive())  # peak learning rate
    # AdamW betas
    betas: list[float] = setting(
        domain=with_lengths(in_range(0, 1, hi_open=True), 2), factory=lambda: [0.9, 0.95]
    )
    eps: float = setting(1e-8, positive())  # AdamW epsilon
    weight_decay: float = setting(0.1, at_least(0))  # decoupled; matrices only (norm gains are not decayed)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after linear warmup
    warmup_steps: int = setting(20, at_least(0))  # linear warmup from 0 to lr
    min_lr: float = setting(3e-4, at_least(0))  # the schedule's floor at max_steps
    # wsd: the last fraction of max_steps decays to min_lr
    decay_fraction: float = setting(0.2, in_range(0, 1, lo_open=True))
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # auto: fused on cuda


@dataclass(kw_only=True)
class ParallelConfig(Section):
    dp_replicate: int = setting(1, at_least(1))  # HSDP replicas (typically across nodes)
    # FSDP shard degree; -1 fills the ranks the other degrees leave
    dp_shard: int = setting(-1, minus_one_or_at_least(1))
    tp: int = setting(1, at_least(1))  # tensor (+ sequence) parallel degree; must stay inside a node
    pp: int = setting(1, at_least(1))  # pipeline stages
    cp: int = setting(1, at_least(1))  # context parallel degree (CUDA only)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"  # pipeline schedule (with pp > 1)
    pp_virtual_stages: int = setting(1, at_least(1))  # stages per pipeline rank (interleaved_1f1b needs >= 2)
    # pipeline micro batches per step; 0: micro batches of train.micro_batch_size sequences (at least pp)
    pp_microbatches: int = setting(0, at_least(0))
    # recompute activations in backward: "full" every block, "selective" part of each block; saves memory
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each transformer block
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on cuda, fp32 on cpu
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the gradient reduce-scatter
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads and optimizer on CPU
    # FSDP frees gathered parameters after forward; default: yes, except with a pipeline (pp > 1)
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    rank_order: str = "tp,cp,pp,dp"  # innermost first: tp ranks are adjacent (same node)
    loss_parallel: bool = True  # with tp > 1: vocab-parallel cross entropy


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    enabled: bool = True  # false: save nothing, take no snapshots, resume no checkpoint of this run
    dir: str = ""  # empty: <run dir>/checkpoints
    interval: int = setting(100, at_least(0))  # save every N steps (0: only at the end and on demand)
    # also save when this much wall time passed (0: off)
    interval_minutes: float = setting(0.0, in_range(0, MAX_SECONDS / 60))
    mode: Literal["sync", "async"] = "sync"  # async: write the checkpoint in the background while training
    keep_last: int = setting(3, at_least(0))  # complete checkpoints kept (0: keep all)
    keep_every: int = setting(0, at_least(0))  # also keep every step divisible by this (0: none)
    save_initial: bool = False  # save step 0 before training
    resume: str = "auto"  # "auto" (newest complete checkpoint of this run), "none", or a path
    init_from: str = ""  # start weights from a checkpoint or HF directory, fresh optimizer
    # check every file's checksum before resuming (reads the checkpoint once more; off for huge ones)
    verify: bool = True
    # when the run has checkpoints but none loads (all damaged), start again at step 0 instead of stopping
    # with an error; the damaged ones stay on disk, never deleted or overwritten
    start_over_if_damaged: bool = False
    # copy the training state into node-local memory (and a peer node's) every N steps (0: off); a crash
    # then resumes from it instead of the last checkpoint (see docs/checkpointing.md, "Snapshots"); "auto":
    # the shortest interval whose measured cost stays within snapshot_max_overhead
    snapshot_every: int | Literal["auto"] = setting(0, zero_or_more_or("auto"))
    # with snapshot_every = "auto": the share of step time snapshots may cost (blocking copy and the
    # slowdown from their background work)
    snapshot_max_overhead: float = setting(0.02, in_range(0, 1, lo_open=True))
    # node-local directory for snapshots, on a tmpfs (memory); each job uses its own folder in it
    snapshot_dir: str = setting("/dev/shm", absolute_path())
    # copies of each rank's snapshot on other nodes (a ring over nodes; clipped to nodes - 1)
    snapshot_replicas: int = setting(1, at_least(0))


@dataclass(kw_only=True)
class ResilienceConfig(Section):
    # signals that make every rank save a checkpoint and stop (a time limit, a preemption, Ctrl-C)
    signals: list[str] = setting(domain=catchable_signal(), factory=lambda: ["SIGTERM", "SIGUSR2", "SIGINT"])
    # what `--signal` in generated sbatch scripts sends
    slurm_signal: str = setting("SIGUSR2", catchable_signal())
    # sbatch --signal=...@N: seconds before the time limit
    signal_lead_s: int = setting(180, in_range(0, 65535))
    # stop when time left < save estimate + this margin
    time_budget_margin_s: float = setting(300.0, seconds())
    # after a stop request, exit by then even if a save hangs
    hard_deadline_s: float = setting(120.0, seconds(zero_ok=False))
    requeue: bool = True  # after a time-limit or preemption stop, rank 0 requeues the job
    max_requeues: int = setting(20, at_least(0))  # cap on requeues for time limits
    # cap on requeues after crashes (a rank killed, an exception, a hang) within one SLURM job
    max_crash_requeues: int = setting(3, at_least(0))
    # after a crash, start the job step again inside the same allocation (no trip through the queue) up
    # to this many times per SLURM job before crashes requeue; 0: every crash requeues
    max_step_restarts: int = setting(3, at_least(0))
    # a node implicated in this many failures of one SLURM job (a hang's culprit, a lost node, the node
    # whose task failed first, a straggler) is kept out of the job's later steps and its next allocation
    # (sbatch --exclude after a requeue); 0: never
    exclude_node_after: int = setting(2, at_least(0))
    # process-group init and the first health all-reduce
    init_timeout_s: float = setting(300.0, seconds(zero_ok=False))
    # every process group's timeout; 0: derived, max(hang_timeout_s, hang_floor_s) + 120, so the hang
    # monitor acts before the backend's own timeout
    collective_timeout_s: float = setting(0.0, seconds())
    # the hang monitor's cap: no phase waits longer without progress; the in-rank watchdog, its backstop,
    # dumps stacks and exits after 1.5 x this without a finished step (0: no cap, no watchdog)
    hang_timeout_s: float = setting(1800.0, seconds())
    # hang monitor: no phase counts as hung before this many seconds without progress
    hang_floor_s: float = setting(40.0, seconds(zero_ok=False))
    # hang monitor: a phase is hung after this multiple of its recent median length without progress
    hang_multiple: float = setting(10.0, in_range(1, 1000, lo_open=True))
    # a NaN/Inf loss or grad norm: stop the run; skip the step; rollback: skip, then reload the checkpoint
    nan_policy: Literal["skip", "stop", "rollback"] = "stop"
    # skip/rollback: this many bad steps in a row escalates
    nan_max_consecutive: int = setting(3, at_least(1))
    # rollback: multiply the LR by this after reloading
    nan_rollback_lr_scale: float = setting(1.0, in_range(0, 1, lo_open=True))
    # a rank whose data, forward or optimizer work is this fraction slower than the other ranks' median in
    # straggler_windows_over of the last straggler_windows windows is named a straggler (0: off)
    straggler_threshold: float = setting(0.1, in_range(0, 10))
    straggler_every: int = setting(5, at_least(1))  # steps per window: the ranks compare times this often
    straggler_windows: int = setting(8, at_least(1))  # recent windows weighed
    # of those, in how many a straggler is slower (at most straggler_windows); it clears when slower in at
    # most straggler_windows - straggler_windows_over of them
    straggler_windows_over: int = setting(5, at_least(1))
    # report: name it; replace: with an idle spare node, stop after the next snapshot for the driver to
    # replace its node (else report); auto: replace, else drop its node when the node range allows and
    # the job is faster without it (else report)
    straggler_action: Literal["report", "replace", "auto"] = "report"
    # in Slurm jobs, before the first step of every job step: relaytrain preflight's checks of each node
    # (about 2 s); report: name a node below threshold in the job log and preflight/JOB.json; exclude: also
    # leave it out before training (a spare in its place, else fewer nodes where slurm.min_nodes allows,
    # else a requeue that excludes it, else the job stops); off: none
    preflight: Literal["off", "report", "exclude"] = "report"
    # under relaytrain's torchrun (a one-node relaytrain launch job's): when a rank's process dies, the
    # other ranks keep their processes, join a new round on the launcher's store and roll back to their
    # newest snapshot (or checkpoint) while the launcher starts a replacement for the lost rank; any failure
    # of that path ends every process, and the job step restarts as without survivors (docs/resilience.md)
    survivors: bool = False
    # survivors in a relaytrain launch job: how many lost ranks one job step replaces alone (its torchrun's
    # --survivor-replacements); the next loss ends the step, which restarts in place (max_step_restarts)
    survivor_replacements: int = setting(3, at_least(1))
    # survivors: the longest wait for the new round (the replacement's start-up and join) before the
    # fallback restart
    survivor_timeout_s: float = setting(120.0, seconds(zero_ok=False))

    def effective_collective_timeout_s(self) -> float:
        """The process groups' timeout: an explicit collective_timeout_s, else (0) the hang monitor's
        longest limit plus a margin, so the backend never aborts a collective the monitor still waits
        for (it names the culprit first)."""
        if self.collective_timeout_s > 0:
            return self.collective_timeout_s
        return max(self.hang_timeout_s, self.hang_floor_s) + COLLECTIVE_TIMEOUT_MARGIN_S


@dataclass(kw_only=True)
class SlurmConfig(Section):
    # cluster profile: a name (configs/clusters/NAME.toml, ...) or the path of a TOML of [slurm] keys
    profile: str = ""
    partition: str = ""  # sbatch --partition (empty: the cluster's default)
    account: str = ""  # sbatch --account
    qos: str = ""  # sbatch --qos
    nodes: int = setting(1, in_range(1, MAX_NODES))  # the most nodes (with min_nodes: the top of the range)
    # 0: exactly `nodes`; else Slurm may start each job of the chain on min_nodes..nodes (--nodes MIN-MAX)
    min_nodes: int = setting(0, in_range(0, MAX_NODES))
    # sbatch --no-kill: a failed node does not end the job, the step restarts on the nodes left (when
    # min_nodes allows) or the job is requeued; auto: on for node ranges (min_nodes), off for fixed counts
    no_kill: Literal["auto", True, False] = "auto"
    # idle nodes the job holds beside `nodes` (sbatch --nodes=nodes+spare_nodes): a failed or excluded
    # node's place goes to one, same world size and layout, no requeue (docs/elastic.md); a straggling
    # node's only when resilience.straggler_action is "replace" or "auto"
    spare_nodes: int = setting(0, in_range(0, MAX_NODES))
    # -1: from the profile, else the partition's GPU GRES in sinfo (gpu:h100:4 -> 4; none -> 0), else 8
    # where sinfo cannot answer; 0: CPU-only nodes (set tasks_per_node)
    gpus_per_node: int = setting(-1, in_range(-1, MAX_PER_NODE))
    gpu_type: str = ""  # h100, h200, a100, mi250x, ... (relaytrain plan); mi*: AMD ROCm/RCCL
    # 0: one task per GPU (CPU-only clusters set this)
    tasks_per_node: int = setting(0, in_range(0, MAX_PER_NODE))
    # CPUs per process, exported as OMP_NUM_THREADS; 0: chosen at launch (with mem and exclusive)
    cpus_per_task: int = setting(0, at_least(0))
    mem: str = ""  # sbatch --mem per node, e.g. "500G" (empty: the partition's default)
    time: str = setting("01:00:00", slurm_time())  # each job's limit (sbatch --time); longer runs requeue
    exclusive: bool = False  # sbatch --exclusive: no other job on the nodes
    mail_user: str = ""  # sbatch --mail-user (empty: no mail)
    mail_type: str = ""  # sbatch --mail-type with mail_user (empty: END,FAIL)
    constraint: str = ""  # sbatch --constraint (node features)
    extra_sbatch: list[str] = field(default_factory=list)  # more "#SBATCH ..." option strings
    env: dict[str, str] = setting(domain=env_table(), factory=dict)  # exported before launch
    # pre-launch shell lines (module load, ...): the only values inserted unquoted, they are code
    setup: list[str] = field(default_factory=list)
    venv: str = ""  # activate this virtualenv (source VENV/bin/activate)
    conda_env: str = ""  # activate this conda environment
    container_image: str = ""  # pyxis/enroot image on the job's srun (building one: docs/containers.md)
    # pyxis mounts, "SRC:DST[:FLAGS]" or "PATH"; the run directory must be mounted at its own path
    container_mounts: list[str] = field(default_factory=list)
    container_workdir: str = ""  # working directory inside the image (empty: the launch directory)
    container_remap_root: bool = False  # pyxis --container-remap-root
    network_interface: str = ""  # empty: detect ib*/hsn*; sets NCCL/GLOO_SOCKET_IFNAME
    nccl_ib_gid_index: int = setting(-1, at_least(-1))  # NCCL_IB_GID_INDEX; -1: leave unset
    # set -x, PYTHONFAULTHANDLER=1, NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL, TORCH_CPP_LOG_LEVEL=INFO,
    # TORCH_SHOW_CPP_STACKTRACES=1 (never CUDA_LAUNCH_BLOCKING: it can deadlock unbatched send/recv)
    debug: bool = False
    modules: list[str] = field(default_factory=list)  # `module load` these before launch
    uv_project: str = ""  # run python through `uv run --project DIR`
    # NCCL_NET_GDR_LEVEL (GPU-direct RDMA); -1 leaves it unset (NCCL detects the topology)
    nccl_net_gdr_level: int = setting(-1, at_least(-1))
    # checkpoint write bandwidth in GB/s, all ranks together (relaytrain plan; reads assumed no faster)
    fs_write_gbps: float = setting(2.0, in_range(0.001, 1e6))


@dataclass(kw_only=True)
class MetricsConfig(Section):
    log_every: int = setting(10, at_least(1))  # steps between logged metrics (step 1 and the last too)
    jsonl: bool = True  # write <run dir>/metrics.jsonl
    tensorboard: bool = True  # write TensorBoard event files into the run directory
    wandb: bool = False  # log to Weights & Biases (needs the wandb package)
    wandb_project: str = "relaytrain"  # the W&B project
    wandb_mode: Literal["online", "offline"] = "offline"  # offline: W&B files only, no upload
    rank_logs: bool = True  # one log file per rank under <run dir>/logs
    # [start, end): torch.profiler window
    profile_steps: list[int] = setting(domain=with_lengths(at_least(0), 0, 2), factory=list)
    # seconds between GPU samples of the per-node sampler (jobs with GPUs; must be > 0)
    gpu_monitor_interval_s: float = setting(5.0, seconds(zero_ok=False))
    # per-device peak FLOP/s for MFU; 0: table for GPUs, measured on CPU
    peak_flops: float = setting(0.0, zero_or_in_range(1e9, 1e18))


# The events an alert can tell of (docs/howto/alerts.md); [notify] events picks from them.
NOTIFY_EVENTS = (
    "started",  # the training started or resumed (each job step)
    "stopped",  # a resumable stop (time limit, preemption, cancel), with its reason
    "requeued",  # the job went back to the queue, with the reason
    "crash_restart",  # a crash, and the job step started again inside the allocation
    "hang",  # the hang monitor found the job step hung and ended it
    "straggler",  # a rank was named a straggler
    "node_excluded",  # a node was left out of the job's later steps
    "no_progress",  # the step count did not advance for notify.no_progress_min minutes
    "finished",  # the run reached train.max_steps
    "failed",  # the run failed and is not retried, with the reason
)


@dataclass(kw_only=True)
class NotifyConfig(Section):
    # the environment variable that holds the webhook URL (the URL itself never goes into the TOML)
    url_env: str = setting("", env_name())
    # or: a file that holds the webhook URL, readable by its owner alone (mode 0600)
    url_file: str = ""
    # the webhook's JSON body: slack: {"text": one line}; json: the event's fields
    format: Literal["slack", "json"] = "slack"
    # a shell command run for each event: the event as JSON on stdin, its name in $RELAYTRAIN_EVENT
    command: str = ""
    # the events to send (default: all)
    events: list[str] = setting(domain=one_of(NOTIFY_EVENTS, "an event"), factory=lambda: list(NOTIFY_EVENTS))
    # no_progress: minutes a running job step may go without a newly logged step (metrics.jsonl, every
    # metrics.log_every steps: keep it above that many steps' time); 0: never tell
    no_progress_min: float = setting(30.0, in_range(0, 100_000))
    retries: int = setting(3, in_range(0, 100))  # tries after a failed delivery, with doubling waits
    backoff_s: float = setting(2.0, in_range(0, 3600))  # the first wait before a retry
    timeout_s: float = setting(10.0, in_range(0.1, 600))  # one delivery's limit (HTTP request, command)
    # events waiting to be sent; more are dropped and counted, training never waits for them
    queue_size: int = setting(100, in_range(1, 100_000))
    # at the job's end: seconds to send what is still queued before the job exits
    drain_s: float = setting(15.0, in_range(0, 600))


@dataclass(kw_only=True)
class Config(Section):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)


def freeze(cfg: Config) -> Config:
    """`cfg` with it and every section read-only (see Section)."""
    for f in dataclasses.fields(cfg):
        object.__setattr__(getattr(cfg, f.name), "_frozen", True)
    object.__setattr__(cfg, "_frozen", True)
    return cfg
