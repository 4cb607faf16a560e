"""Checks before any work starts: every field's own domain (declared in schema.py), then the checks
that relate two or more fields and need no process group.

Layout checks that need the world size and node shape live in relaytrain.parallel.layout.
"""

from __future__ import annotations

from relaytrain.config.domains import check_domains
from relaytrain.config.schema import Config
from relaytrain.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    check_domains(cfg)
    m, t, o, r = cfg.model, cfg.train, cfg.optim, cfg.resilience
    _require(m.dim % m.n_heads == 0, f"model.n_heads={m.n_heads} must divide model.dim={m.dim}")
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}",
    )
    _require(
        (m.dim // m.n_heads) % 2 == 0,
        f"head dim model.dim/model.n_heads={m.dim // m.n_heads} must be even for RoPE",
    )
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.micro_batch_size={t.micro_batch_size} must divide "
        f"train.global_batch_size={t.global_batch_size}",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len",
    )
    _require(
        o.min_lr <= o.lr,
        f"optim.min_lr={o.min_lr} must not exceed optim.lr={o.lr}; the schedule decays from lr to min_lr",
    )
    d = cfg.data
    _require(
        not d.weights or len(d.weights) == len(d.sources),
        f"data.weights has {len(d.weights)} entries but data.sources has {len(d.sources)}",
    )
    _require(
        r.hard_deadline_s < r.signal_lead_s,
        f"resilience.hard_deadline_s={r.hard_deadline_s} must be shorter than "
        f"resilience.signal_lead_s={r.signal_lead_s}, or the kill comes before the deadline",
    )
    _require(
        r.straggler_windows_over <= r.straggler_windows,
        f"resilience.straggler_windows_over={r.straggler_windows_over} must not exceed "
        f"resilience.straggler_windows={r.straggler_windows}, the windows weighed; lower it or weigh more "
        "windows",
    )
    _require(
        r.slurm_signal in r.signals,
        f"resilience.slurm_signal={r.slurm_signal!r} must be in resilience.signals={r.signals}, "
        "or Slurm's time-limit signal kills the ranks without a checkpoint",
    )
    c = cfg.checkpoint
    _require(
        c.enabled or not c.snapshot_every,
        f"checkpoint.snapshot_every={c.snapshot_every!r} takes no snapshot while checkpoint.enabled=false "
        "(nothing is saved at all); set checkpoint.snapshot_every=0, or checkpoint.enabled=true with "
        "checkpoint.interval=0 for snapshots without periodic checkpoints",
    )
    ps = cfg.metrics.profile_steps
    _require(
        not ps or ps[0] < ps[1],
        f"metrics.profile_steps={ps} must be [start, end) with start < end",
    )
    _require(
        "NCCL_TIMEOUT" not in cfg.slurm.env,
        "slurm.env sets NCCL_TIMEOUT, which neither NCCL nor PyTorch reads; remove it and set "
        "resilience.collective_timeout_s (seconds) instead",
    )
