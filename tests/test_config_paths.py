"""Relative paths in a config file are relative to its directory; on the command line, to the current one.
prepare-data's hint is enough to train on what it wrote."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import config_to_toml, load_config
from relaytrain.data import resolve_sources
from relaytrain.errors import UserError

CONFIG = """
[run]
dir = "runs"

[data]
sources = ["data/a", "/abs/b", "~/c"]
tokenizer = "tok/tokenizer.json"

[checkpoint]
init_from = "../weights"
resume = "auto"

[slurm]
profile = "mycluster"
"""


def test_input_paths_in_a_config_file_are_relative_to_its_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.toml").write_text(CONFIG)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(Path("..") / "project" / "train.toml")
    base = elsewhere / ".." / "project"
    assert cfg.data.sources == [str(base / "data/a"), "/abs/b", "~/c"]
    assert cfg.data.tokenizer == str(base / "tok/tokenizer.json")
    assert cfg.checkpoint.init_from == str(base / "../weights")
    assert cfg.checkpoint.resume == "auto" and cfg.slurm.profile == "mycluster"  # words, not paths
    assert cfg.run.dir == "runs"  # an output: relative to the current directory

    # On the command line a path is relative to the current directory. Made absolute at load, it means
    # the same in the config a run saves and a launched job loads from another directory.
    cfg = load_config(
        project / "train.toml",
        ["--data.sources=['here']", "--data.tokenizer=byte", "--checkpoint.resume=ckpt/step_5"],
    )
    assert cfg.data.sources == [str(elsewhere / "here")] and cfg.data.tokenizer == "byte"
    assert cfg.checkpoint.resume == str(elsewhere / "ckpt/step_5")
    saved = project / "runs" / "x" / "slurm" / "config.toml"
    saved.parent.mkdir(parents=True)
    saved.write_text(config_to_toml(cfg))
    assert load_config(saved) == cfg

    (project / "p.toml").write_text('[checkpoint]\nresume = "old/step_3"\n[slurm]\nprofile = "c/x.toml"\n')
    cfg = load_config(project / "p.toml")
    assert cfg.checkpoint.resume == str(project / "old/step_3")
    assert cfg.slurm.profile == str(project / "c/x.toml")


def test_prepare_data_hint_is_enough_to_train_on_its_output(tmp_path, monkeypatch, capsys):
    from test_data import DOCS, train_bpe

    monkeypatch.chdir(tmp_path)
    tok = train_bpe(tmp_path / "tok.json", vocab_size=400)  # more than the default model.vocab_size
    (tmp_path / "d.txt").write_text("\n\n".join(DOCS * 5))
    assert main(["prepare-data", "d.txt", "--out", "data/d", "--tokenizer", str(tok), "--workers", "1"]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("use it with: "))
    overrides = shlex.split(hint.removeprefix("use it with: "))
    assert "--model.vocab_size=400" in overrides
    cfg = load_config(None, overrides)
    assert resolve_sources(cfg.data, vocab_size=cfg.model.vocab_size, runs_dir=cfg.run.dir) == [
        tmp_path / "data/d"
    ]


def test_a_byte_config_on_data_of_another_tokenizer_names_each_once(tmp_path, monkeypatch):
    from test_data import DOCS, train_bpe

    monkeypatch.chdir(tmp_path)
    tok = train_bpe(tmp_path / "tok.json")
    (tmp_path / "d.txt").write_text("\n\n".join(DOCS * 5))
    assert main(["prepare-data", "d.txt", "--out", "d", "--tokenizer", str(tok), "--workers", "1"]) == 0
    with pytest.raises(UserError) as err:
        cfg = load_config(None, ["--data.sources=['d']"])
        resolve_sources(cfg.data, vocab_size=cfg.model.vocab_size, runs_dir=cfg.run.dir)
    message = str(err.value)
    assert "but data.tokenizer is 'byte'; set data.tokenizer to" in message
    assert "'byte' is 'byte'" not in message
