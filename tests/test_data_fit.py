"""A preset never trains on the bundled toy corpus unnoticed: `train`, `plan`, `launch` and `doctor` refuse,
in one line with exit 2, a model.vocab_size its tokenizer cannot fill and a run that would read its data
more than 100 times, unless data.allow_small = true (relaytrain.data.fit)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.data import prepare_dataset
from relaytrain.data.fit import check_data_fits
from relaytrain.data.sources import BUNDLED_CORPUS
from relaytrain.data.tokenizer import tokenizer_name
from relaytrain.errors import ConfigError

from conftest import REPO, child_env

# Runs the CLI as `relaytrain` does, then says whether torch was ever imported (test_cli_fast_errors.py).
WRAPPER = (
    "import sys; from relaytrain.cli import main; code = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)"
)
DEBUG = str(REPO / "configs" / "debug.toml")
PRESET_8B = str(REPO / "configs" / "8b.toml")
FIX = "relaytrain prepare-data INPUT --tokenizer TOKENIZER --out DIR"
# The bundled corpus's UTF-8 bytes: at most one token each, counted here from the file itself.
CORPUS_BYTES = len(gzip.decompress(BUNDLED_CORPUS.read_bytes()))
DEBUG_STEP_TOKENS = 16 * 128  # configs/debug.toml: global_batch_size x seq_len


def refusal(argv: list[str], cwd) -> str:
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], cwd=cwd, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error, imported = proc.stderr.strip().splitlines()
    assert error.startswith("relaytrain: error: ") and imported == "torch imported: False", proc.stderr
    assert FIX in error and "data.allow_small=true" in error, error
    return error


@pytest.mark.parametrize("command", ["train", "plan", "doctor"])
def test_the_8b_preset_on_the_bundled_corpus_is_refused_for_both_reasons(command, tmp_path):
    argv = [command, PRESET_8B] + (
        ["--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100"] if command == "plan" else []
    )
    error = refusal(argv, tmp_path)
    assert "model.vocab_size=128256 but data.tokenizer='byte' has 258 ids" in error
    assert "2 x 258 + 1024 = 1540" in error
    planned = 100000 * 512 * 8192
    assert f"plans {planned:,} tokens" in error and f"about {CORPUS_BYTES:,}" in error
    assert f"{planned / CORPUS_BYTES:,.0f} epochs, over the 100 allowed" in error


def test_launch_refuses_before_writing_anything(tmp_path):
    argv = ["launch", PRESET_8B, "--dry-run", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu"]
    assert "model.vocab_size=128256" in refusal(argv, tmp_path)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("vocab", "refused"), [(2 * 258 + 1024, False), (2 * 258 + 1025, True)]
)  # fmt: skip
def test_the_vocabulary_rule_at_its_edge(vocab, refused):
    cfg = load_config(DEBUG, [f"--model.vocab_size={vocab}"])
    if not refused:
        check_data_fits(cfg)
        return
    with pytest.raises(ConfigError, match=rf"model.vocab_size={vocab} .* = 1540 allowed"):
        check_data_fits(cfg)


def test_the_epoch_rule_at_its_edge():
    """100 epochs of the bundled corpus pass, one step more is refused."""
    steps = 100 * CORPUS_BYTES // DEBUG_STEP_TOKENS
    check_data_fits(load_config(DEBUG, [f"--train.max_steps={steps}"]))
    with pytest.raises(ConfigError, match=r"over the 100 allowed") as refused:
        check_data_fits(load_config(DEBUG, [f"--train.max_steps={steps + 1}"]))
    assert "model.vocab_size" not in str(refused.value)


def test_train_refuses_an_exhausted_prepared_source_through_the_cli(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("\n\n".join(f"document {i}: a few words of text." for i in range(20)))
    data = prepare_dataset([str(text)], tmp_path / "data", tokenizer="byte", val_fraction=0.0)
    tokens = json.loads((data / "meta.json").read_text())["splits"]["train"]["tokens"]
    sources = f"--data.sources=['{data}']"
    steps = 100 * tokens // DEBUG_STEP_TOKENS + 1  # one step past 100 epochs of its tokens
    error = refusal(["train", DEBUG, sources, f"--train.max_steps={steps}"], tmp_path)
    planned = steps * DEBUG_STEP_TOKENS
    assert f"but data.sources holds about {tokens:,}: {planned / tokens:,.0f} epochs" in error
    assert "model.vocab_size" not in error
    check_data_fits(load_config(DEBUG, [sources, f"--train.max_steps={steps}", "--data.allow_small=true"]))
    check_data_fits(load_config(DEBUG, [sources, f"--train.max_steps={steps - 1}"]))


def test_allow_small_lets_the_preset_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["plan", PRESET_8B, "--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100"]
    assert main([*argv, "--data.allow_small=true"]) == 0
    assert "verdict:" in capsys.readouterr().out


def test_a_command_launch_reads_its_own_data(tmp_path, monkeypatch, capsys):
    """--command runs another program: the trainer's data rule does not apply to it."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", PRESET_8B, "--command", "python train.py", "--name", "prog", "--dry-run"]
    assert main(argv) == 0, capsys.readouterr().err


def test_the_debug_config_fits_for_a_reason():
    """The embedded default trains well inside both rules: its 320 entries pad the byte tokenizer's 258
    ids, and its 200 steps read under half the bundled corpus."""
    cfg = load_config(None)
    assert not cfg.data.allow_small and cfg.model.vocab_size <= 2 * 258 + 1024
    assert cfg.train.max_steps * DEBUG_STEP_TOKENS < CORPUS_BYTES / 2
    check_data_fits(cfg)


def test_data_this_machine_cannot_see_is_left_to_the_ranks(tmp_path):
    """A login node may not mount what the nodes read: a source without a meta.json here is not counted
    (train checks it where the ranks start), while the byte tokenizer, known everywhere, still is."""
    unseen = f"--data.sources=['{tmp_path / 'on-the-nodes-only'}']"
    check_data_fits(load_config(DEBUG, [unseen, "--train.max_steps=1000000"]))
    with pytest.raises(ConfigError, match=r"model.vocab_size=2000 but data.tokenizer='byte' has 258 ids"):
        check_data_fits(load_config(DEBUG, [unseen, "--model.vocab_size=2000"]))


@pytest.mark.parametrize("command", ["train", "launch"])
def test_data_of_another_tokenizer_is_refused_before_the_job(command, tmp_path):
    """Data prepared with a tokenizer.json, and a command line that leaves out data.tokenizer (so 'byte'):
    the ranks would refuse it at their start (data.sources.check_tokenizer); train and launch refuse it
    first, in one line naming the tokenizer to set, and launch writes nothing. allow_small lifts no part
    of it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("a b a\n\nb a b")
    data = prepare_dataset(
        [str(tmp_path / "t.txt")], tmp_path / "data", tokenizer=str(tmp_path / "tokenizer.json")
    )
    extra = ["--dry-run", "--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "1"] * (
        command == "launch"
    )
    argv = [command, DEBUG, f"--data.sources=['{data}']", "--data.allow_small=true", *extra]
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    error, imported = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and imported == "torch imported: False", proc.stderr
    theirs = tokenizer_name(str(tmp_path / "tokenizer.json"))
    assert error == (
        f"relaytrain: error: {data} was prepared with tokenizer '{theirs}' "
        f"but data.tokenizer is 'byte'; set data.tokenizer to {data / 'tokenizer.json'}, or prepare the data "
        "with the same tokenizer"
    )
    assert not (tmp_path / "runs").exists()
