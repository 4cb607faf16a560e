"""Config parsing, overrides and every rejection the foundation issue lists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import (
    Config,
    SlurmConfig,
    config_from_dict,
    config_hash,
    config_to_dict,
    config_to_toml,
    load_config,
)
from relaytrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_default_is_debug_toml():
    embedded = config_to_dict(load_config(None))
    from_file = config_to_dict(load_config(REPO / "configs" / "debug.toml"))
    assert embedded == from_file


def test_overrides_apply_typed_values():
    cfg = load_config(
        REPO / "configs" / "1b.toml",
        ["--train.max_steps=3000", "--optim.betas=[0.8, 0.9]", "--run.name=x", "--parallel.compile=true"],
    )
    assert cfg.train.max_steps == 3000 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.run.name == "x" and cfg.parallel.compile is True
    assert cfg.model.dim == 2048  # from the file


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ['--slurm.env={A = "1"}', '--data.sources=["a", "b"]'])
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    again = load_config(path)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_hash_ignores_run_name_but_not_model():
    a, b = load_config(None), load_config(None, ["--run.name=other", "--train.stop_at_step=5"])
    c = load_config(None, ["--model.dim=128"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("--train.max_stepz=3", "unknown config key 'train.max_stepz'; did you mean 'train.max_steps'"),
        ("--trian.max_steps=3", "unknown config section '[trian]'; did you mean 'train'"),
        ("--train.max_steps=abc", "'train.max_steps' expects int, got 'abc'"),
        ("--train.grad_clip=true", "'train.grad_clip' expects float, got True"),
        ("--optim.schedule=linear", "'optim.schedule' expects one of 'cosine', 'wsd', 'constant'"),
        ("--model.n_heads=7", "model.n_heads=7 must divide model.dim=256"),
        ("--model.n_kv_heads=3", "model.n_kv_heads=3 must divide model.n_heads=8"),
        ("--train.micro_batch_size=5", "train.micro_batch_size=5 must divide train.global_batch_size=16"),
        ("--train.seq_len=4096", "train.seq_len=4096 exceeds model.max_seq_len=2048"),
        ("--resilience.hard_deadline_s=500", "must be shorter than resilience.signal_lead_s"),
        (
            "--resilience.straggler_windows=4",
            "resilience.straggler_windows_over=5 must not exceed resilience.",
        ),
        ('--resilience.signals=["SIGFOO"]', "resilience.signals[0]='SIGFOO' is not allowed: must be a catch"),
        ('--resilience.signals=["SIGTERM", "SIGKILL"]', "resilience.signals[1]='SIGKILL' is not allowed"),
        ('--resilience.signals=["SIG_DFL"]', "resilience.signals[0]='SIG_DFL' is not allowed"),
        ("--model.multiple_of=0", "model.multiple_of=0 is not allowed: must be >= 1"),
        ("--model.ffn_dim_multiplier=nan", "ffn_dim_multiplier=nan is not allowed: floats must be finite"),
        ("--resilience.hang_timeout_s=1e308", "hang_timeout_s=1e+308 is not allowed: must be in [0,"),
        ("--model.init_std=-0.1", "model.init_std=-0.1 is not allowed: must be in (0, 1]"),
        ("--optim.lr=inf", "optim.lr=inf is not allowed: floats must be finite"),
        ("--optim.eps=0", "optim.eps=0.0 is not allowed: must be > 0"),
        ("--model.rope_theta=-1", "model.rope_theta=-1.0 is not allowed: must be > 0"),
        ("--model.norm_eps=0", "model.norm_eps=0.0 is not allowed"),
        ("--resilience.nan_rollback_lr_scale=-0.5", "resilience.nan_rollback_lr_scale=-0.5 is not allowed"),
        ("--train.grad_clip=-1", "train.grad_clip=-1.0 is not allowed: must be >= 0"),
        ("--run.name=..", "run.name='..' is not allowed: must be a directory name"),
        ("--run.name=a%jb", "run.name='a%jb' is not allowed"),
        ("--run.dir=/tmp/%u", "run.dir='/tmp/%u' is not allowed"),
        ("--run.name=a\x00b", "run.name='a\\x00b' is not allowed: text must be printable"),
        ("--run.name=a\udcffb", "run.name='a\\udcffb' is not allowed: text must be printable"),
        ("--optim.betas=[0.9]", "optim.betas=[0.9] is not allowed: must be 2 values, each in [0, 1)"),
        ("--slurm.env={'A B' = '1'}", "slurm.env={'A B': '1'} is not allowed"),
        ("max_steps=3", "unexpected argument 'max_steps=3': overrides look like --section.key=value"),
        ("--train\n.x=1", "unknown config section '[train\\n]'"),
    ],
)
def test_rejections_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


def test_bad_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'model.dim'"):
        load_config(typo)


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["train", "--train.max_stepz=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: ") and "Traceback" not in err[0]
    assert main(["train", "configs/nope.toml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_time_like_override_stays_a_string():
    assert load_config(None, ["--slurm.time=02:00:00"]).slurm.time == "02:00:00"
    # a text field keeps an override's text: 30 minutes, not the integer 30 (which it would refuse)
    assert load_config(None, ["--slurm.time=30", "--run.name=1.50"]).slurm.time == "30"
    assert load_config(None, ["--run.name=1.50"]).run.name == "1.50"


def test_schedule_fits_a_run_shorter_than_its_phases():
    from relaytrain.config import OptimConfig
    from relaytrain.optim import lr_at, schedule_fit_warning

    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=20)
    lrs = [lr_at(cos, step, 5) for step in range(1, 6)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.1])  # warmup to the peak, then the floor
    assert "the warmup runs 4 steps instead of optim.warmup_steps=20" in schedule_fit_warning(cos, 5)
    assert lr_at(cos, 1, 1) == pytest.approx(0.1)  # a one-step run still gets a finite LR
    assert schedule_fit_warning(cos, 200) is None and cos.warmup_steps == 20  # the config is untouched
    wsd = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=6, schedule="wsd", decay_fraction=0.5)
    assert [lr_at(wsd, s, 10) for s in range(6, 11)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert "the decay runs the last 4 steps instead of the 5" in schedule_fit_warning(wsd, 10)


def test_a_shortened_run_trains_with_one_warning(tmp_path):
    from conftest import TINY, read_metrics, run_cli

    result = run_cli(
        ["train", *TINY, "--optim.warmup_steps=20", "--train.max_steps=5", f"--run.dir={tmp_path}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "train.max_steps=5 is shorter than the LR schedule" in warnings[0]
    assert [r["step"] for r in read_metrics(tmp_path / "debug")] == [1, 2, 3, 4, 5]


def test_a_loaded_config_is_read_only():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError, match="TrainConfig.max_steps is read-only"):
        cfg.train.max_steps = 5
    with pytest.raises(dataclasses.FrozenInstanceError, match="Config.slurm is read-only"):
        cfg.slurm = SlurmConfig()
    variant = dataclasses.replace(cfg.train, max_steps=cfg.train.max_steps + 1)  # a new, own section
    variant.max_steps += 1
    assert variant.max_steps == cfg.train.max_steps + 2
    built = Config()  # built by hand (tests, benchmarks), not validated: stays writable
    built.train.max_steps = 5
    assert built.train.max_steps == 5


def test_derived_values_are_validated_with_the_config():
    """What a command derives (the launcher's profile and flags) is checked like the file's values."""
    with pytest.raises(ConfigError, match=r"slurm.nodes=0 is not allowed: must be in \[1, 100000\]"):
        load_config(None, [], {"slurm": {"nodes": 0}})
    with pytest.raises(ConfigError, match=r"config key 'resilience.requeue' expects bool"):
        load_config(None, [], {"resilience": {"requeue": "no"}})
    cfg = load_config(None, ["--slurm.nodes=2", "--slurm.env={A = '1'}"], {"slurm": {"nodes": 3}})
    assert cfg.slurm.nodes == 3 and cfg.slurm.env == {"A": "1"}


def test_snapshots_with_checkpointing_off_are_refused_not_ignored():
    for every in ("1", "auto"):
        with pytest.raises(ConfigError, match=r"no snapshot while checkpoint.enabled=false.*interval=0"):
            load_config(None, ["--checkpoint.enabled=false", f"--checkpoint.snapshot_every={every}"])
    cfg = load_config(None, ["--checkpoint.interval=0", "--checkpoint.snapshot_every=1"])
    assert cfg.checkpoint.enabled and cfg.checkpoint.snapshot_every == 1
    assert not load_config(None, ["--checkpoint.enabled=false"]).checkpoint.snapshot_every
