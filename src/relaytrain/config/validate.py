"""Cross-field checks that need no process group: run before any work starts.

Layout checks that need the world size and node shape live in relaytrain.parallel.layout.
"""

from __future__ import annotations

import signal

from relaytrain.config.schema import Config
from relaytrain.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    m, t, o, p, c, r = cfg.model, cfg.train, cfg.optim, cfg.parallel, cfg.checkpoint, cfg.resilience
    _require(
        cfg.run.name.strip() != "" and "/" not in cfg.run.name,
        f"run.name {cfg.run.name!r} must be a non-empty name without '/'",
    )
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
        _require(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    _require(m.dim % m.n_heads == 0, f"model.n_heads={m.n_heads} must divide model.dim={m.dim}")
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}",
    )
    _require(
        (m.dim // m.n_heads) % 2 == 0,
        f"head dim model.dim/model.n_heads={m.dim // m.n_heads} must be even for RoPE",
    )
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "seq_len"):
        _require(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.micro_batch_size={t.micro_batch_size} must divide "
        f"train.global_batch_size={t.global_batch_size}",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len",
    )
    _require(t.stop_at_step >= 0, f"train.stop_at_step must be >= 0, got {t.stop_at_step}")
    _require(t.eval_every >= 0 and t.eval_steps >= 0, "train.eval_every and train.eval_steps must be >= 0")
    _require(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"optim.betas must be two numbers in [0, 1), got {o.betas}",
    )
    _require(
        o.lr > 0 and 0 <= o.min_lr <= o.lr,
        f"need 0 <= optim.min_lr <= optim.lr and lr > 0 (lr={o.lr}, min_lr={o.min_lr})",
    )
    _require(
        0 <= o.warmup_steps < t.max_steps,
        f"optim.warmup_steps={o.warmup_steps} must be below train.max_steps={t.max_steps}",
    )
    _require(0 < o.decay_fraction <= 1, f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    d = cfg.data
    _require(
        not d.weights or len(d.weights) == len(d.sources),
        f"data.weights has {len(d.weights)} entries but data.sources has {len(d.sources)}",
    )
    _require(all(w > 0 for w in d.weights), f"data.weights must be positive, got {d.weights}")
    for key in ("dp_replicate", "tp", "pp", "cp", "pp_virtual_stages"):
        _require(getattr(p, key) >= 1, f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    _require(p.dp_shard == -1 or p.dp_shard >= 1, f"parallel.dp_shard must be -1 or >= 1, got {p.dp_shard}")
    _require(p.pp_microbatches >= 0, "parallel.pp_microbatches must be >= 0")
    _require(
        c.interval >= 0 and c.keep_last >= 0 and c.keep_every >= 0,
        "checkpoint.interval, keep_last and keep_every must be >= 0",
    )
    for name in list(r.signals) + [r.slurm_signal]:
        _require(
            name.startswith("SIG") and hasattr(signal, name),
            f"resilience signal {name!r} is not a signal name like 'SIGTERM'",
        )
    _require(
        r.hard_deadline_s < r.signal_lead_s,
        f"resilience.hard_deadline_s={r.hard_deadline_s} must be shorter than "
        f"resilience.signal_lead_s={r.signal_lead_s}, or the kill comes before the deadline",
    )
    _require(r.max_requeues >= 0, "resilience.max_requeues must be >= 0")
    _require(
        r.slurm_signal in r.signals,
        f"resilience.slurm_signal={r.slurm_signal!r} must be in resilience.signals={r.signals}, "
        "or Slurm's time-limit signal kills the ranks without a checkpoint",
    )
    _require(
        r.hang_timeout_s >= 0 and r.hard_deadline_s > 0 and r.nan_max_consecutive >= 1,
        "need resilience.hang_timeout_s >= 0 (0: off), hard_deadline_s > 0, nan_max_consecutive >= 1",
    )
    _require(cfg.metrics.log_every >= 1, f"metrics.log_every must be >= 1, got {cfg.metrics.log_every}")
    ps = cfg.metrics.profile_steps
    _require(
        not ps or (len(ps) == 2 and 0 <= ps[0] < ps[1]),
        f"metrics.profile_steps must be [start, end) with start < end, got {ps}",
    )
