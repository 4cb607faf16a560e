"""Typed config sections. Every key a user may write in TOML is a field here.

Each field's comment is the user-facing documentation (docs/config.md is generated from the
same names). Defaults are the embedded debug run: a tiny model on the bundled corpus, on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RunConfig:
    name: str = "debug"  # run directory is <dir>/<name>; the same name resumes the same run
    dir: str = "runs"  # parent of run directories
    seed: int = 0  # seeds model init, data order and dropout-free RNG streams
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu


@dataclass
class ModelConfig:
    preset: str = "debug"  # informational name of the size preset the config came from
    dim: int = 256  # model width (hidden size)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # attention (query) heads; head dim = dim / n_heads
    n_kv_heads: int = 4  # grouped-query attention: heads share n_heads // n_kv_heads KV heads
    vocab_size: int = 320  # >= the tokenizer's vocabulary; padded for tensor-parallel splits
    ffn_dim: int = 0  # 0: Llama rule from dim, ffn_dim_multiplier and multiple_of
    ffn_dim_multiplier: float = 1.0  # Llama rule: scales 8/3 * dim
    multiple_of: int = 64  # Llama rule: the FFN width is rounded up to this
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base (Llama 3: 500000)
    max_seq_len: int = 2048  # RoPE table length; must be >= train.seq_len
    tie_embeddings: bool = False  # output projection shares the embedding matrix
    init_std: float = 0.02  # output projections are scaled by 1/sqrt(2 * n_layers)


@dataclass
class DataConfig:
    # Prepared dataset directories (from `relaytrain prepare-data`). Empty: the bundled corpus,
    # tokenized on first use with the byte tokenizer into <run.dir>/.cache.
    sources: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # mixture weights; empty: equal
    tokenizer: str = "byte"  # "byte" or a local tokenizer.json; must match the prepared data
    shuffle: bool = True


@dataclass
class TrainConfig:
    max_steps: int = 200  # the LR schedule spans this many optimizer steps
    global_batch_size: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 128
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_every: int = 100  # 0 disables evaluation
    eval_steps: int = 4  # validation micro-batches per evaluation
    stop_at_step: int = 0  # end this job after that step with a checkpoint (0: run to max_steps)


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled; matrices only (norm gains are not decayed)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after linear warmup
    warmup_steps: int = 20  # linear warmup from 0 to lr
    min_lr: float = 3e-4  # the schedule's floor at max_steps
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps decays to min_lr
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # auto: fused on cuda


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # HSDP replicas (typically across nodes)
    dp_shard: int = -1  # FSDP shard degree; -1 fills the ranks the other degrees leave
    tp: int = 1  # tensor (+ sequence) parallel degree; must stay inside a node
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel degree (CUDA only)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b needs >= 2)
    pp_microbatches: int = 0  # 0: pp (one microbatch per stage)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each transformer block
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on cuda, fp32 on cpu
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads and optimizer on CPU
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    rank_order: str = "tp,cp,pp,dp"  # innermost first: tp ranks are adjacent (same node)
    loss_parallel: bool = True  # with tp > 1: vocab-parallel cross entropy


@dataclass
class CheckpointConfig:
    enabled: bool = True
    dir: str = ""  # empty: <run dir>/checkpoints
    interval: int = 100  # save every N steps (0: only at the end and on demand)
    interval_minutes: float = 0.0  # also save when this much wall time passed (0: off)
    mode: Literal["sync", "async"] = "sync"
    keep_last: int = 3  # complete checkpoints kept (0: keep all)
    keep_every: int = 0  # also keep every step divisible by this (0: none)
    save_initial: bool = False  # save step 0 before training
    resume: str = "auto"  # "auto" (newest complete checkpoint of this run), "none", or a path
    init_from: str = ""  # start weights from a checkpoint or HF directory, fresh optimizer


@dataclass
class ResilienceConfig:
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR2", "SIGINT"])
    slurm_signal: str = "SIGUSR2"  # what `--signal` in generated sbatch scripts sends
    signal_lead_s: int = 180  # sbatch --signal=...@N: seconds before the time limit
    time_budget_margin_s: float = 300.0  # stop when time left < save estimate + this margin
    hard_deadline_s: float = 120.0  # after a stop request, exit by then even if a save hangs
    requeue: bool = True  # after a time-limit or preemption stop, rank 0 requeues the job
    max_requeues: int = 20  # cap on requeues for time limits
    init_timeout_s: float = 120.0  # process-group init and the first health all-reduce
    collective_timeout_s: float = 1800.0  # timeout of training collectives
    hang_timeout_s: float = 1800.0  # watchdog: no finished step for this long dumps stacks and exits
    nan_policy: Literal["skip", "stop", "rollback"] = "stop"
    nan_max_consecutive: int = 3  # skip/rollback: this many bad steps in a row escalates
    nan_rollback_lr_scale: float = 1.0  # rollback: multiply the LR by this after reloading


@dataclass
class SlurmConfig:
    profile: str = ""  # cluster profile TOML (partition, account, gpus per node, network, env)
    partition: str = ""
    account: str = ""
    qos: str = ""
    nodes: int = 1
    gpus_per_node: int = -1  # -1: from the profile, else 8; 0: CPU-only nodes (set tasks_per_node)
    gpu_type: str = ""  # h100, h200, a100, mi250x, ... (relaytrain plan); mi*: AMD ROCm/RCCL
    tasks_per_node: int = 0  # 0: one task per GPU (CPU-only clusters set this)
    cpus_per_task: int = 0  # 0: let Slurm decide; sets OMP_NUM_THREADS
    mem: str = ""
    time: str = "01:00:00"
    exclusive: bool = False
    mail_user: str = ""
    mail_type: str = ""
    constraint: str = ""
    extra_sbatch: list[str] = field(default_factory=list)  # more "#SBATCH ..." option strings
    env: dict[str, str] = field(default_factory=dict)  # exported before launch
    setup: list[str] = field(default_factory=list)  # pre-launch shell lines (module load, ...)
    venv: str = ""  # activate this virtualenv
    conda_env: str = ""
    container_image: str = ""  # pyxis/enroot image
    container_mounts: list[str] = field(default_factory=list)
    container_workdir: str = ""
    container_remap_root: bool = False
    network_interface: str = ""  # empty: detect ib*/hsn*; sets NCCL/GLOO_SOCKET_IFNAME
    nccl_ib_gid_index: int = -1  # -1: leave unset
    debug: bool = False  # PYTHONFAULTHANDLER, NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL
    modules: list[str] = field(default_factory=list)  # `module load` these before launch
    uv_project: str = ""  # run python through `uv run --project DIR`
    nccl_net_gdr_level: int = 2  # NCCL_NET_GDR_LEVEL (GPU-direct RDMA); -1 leaves it unset
    fs_write_gbps: float = 2.0  # checkpoint write bandwidth in GB/s (relaytrain plan)


@dataclass
class MetricsConfig:
    log_every: int = 10
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "relaytrain"
    wandb_mode: Literal["online", "offline"] = "offline"
    rank_logs: bool = True  # one log file per rank under <run dir>/logs
    profile_steps: list[int] = field(default_factory=list)  # [start, end): torch.profiler window
    gpu_monitor_interval_s: float = 5.0
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0: table for GPUs, measured on CPU


@dataclass
class Config:
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
