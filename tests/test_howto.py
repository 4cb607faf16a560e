"""The how-to pages (docs/howto/): linked first from the README, each a few commands and what to do when
it goes wrong, and their commands run as written where they need no cluster and no data of the user's.

Every `relaytrain` line of them parses (tests/test_docs_cli.py); here the plan lines run, the pages about
a finished run (status, logs, report, verify, export) run on a copy of a tiny stopped and resumed run, and the
4-node 8B launch loads as a config with the user's data.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from relaytrain.config.overrides import split_config_args
from test_docs_cli import bash_lines, parse_line

import needs
from conftest import child_env

REPO = Path(__file__).resolve().parents[1]
HOWTO = REPO / "docs" / "howto"
PAGES = sorted(HOWTO.glob("*.md"))


def _run(line: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def _copy_run(run: Path, cwd: Path) -> None:
    shutil.copytree(run, cwd / "runs" / "8b", symlinks=True)


def test_the_pages_are_there():
    names = {page.stem for page in PAGES}
    assert names == {
        "train-on-your-data",
        "preemption-and-time-limits",
        "crashes-and-hangs",
        "slow-node",
        "where-the-time-went",
        "resume-on-another-node-count",
        "export-to-hugging-face",
        "your-own-program",
        "alerts",
        "preflight",
    }


def test_the_readme_links_the_howto_pages_first():
    links = re.findall(r"\]\((docs/[^)#]+)", (REPO / "README.md").read_text())
    assert sorted(links[: len(PAGES)]) == sorted(f"docs/howto/{page.name}" for page in PAGES), links[:10]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_each_page_has_commands_and_says_what_to_do_when_it_goes_wrong(page):
    text = page.read_text()
    assert text.startswith("# ") and "\n## When it goes wrong\n" in text
    assert bash_lines(page), f"{page.name} has no commands"


def test_the_4_node_8b_launch_trains_the_users_data():
    """The launch line of the train page: 8B on 4 nodes of 8 GPUs, on data the user prepared, with the
    model's tokenizer; as a config it loads, and it names no toy-run escape."""
    from relaytrain.config import load_config

    (line,) = [
        line for line in bash_lines(HOWTO / "train-on-your-data.md") if line.startswith("relaytrain launch ")
    ]
    (args,) = parse_line(line)
    assert args.config == "configs/8b.toml" and args.nodes[1] == 4 and args.gpus_per_node == 8
    words = shlex.split(line)
    overrides = [w for w in words if w.startswith("--data.")]
    config, overrides = split_config_args([str(REPO / args.config), *overrides])
    cfg = load_config(config, overrides)
    assert cfg.data.sources and cfg.data.tokenizer.endswith("tokenizer.json") and not cfg.data.allow_small
    prepare = [line for line in bash_lines(HOWTO / "train-on-your-data.md") if "prepare-data" in line]
    (prepared,) = parse_line(prepare[0])  # the data and the tokenizer the launch names are those prepared
    assert [Path(source).name for source in cfg.data.sources] == [Path(prepared.out).name]
    assert Path(cfg.data.tokenizer).name == Path(prepared.tokenizer).name


def test_every_preset_command_names_the_users_data_or_a_toy_run():
    """train, plan, launch and doctor refuse a size preset on the bundled toy corpus (relaytrain.data.fit):
    a page's line that names neither data nor `--data.allow_small=true` would stop with exit 2."""
    checked = ("train", "plan", "launch", "doctor")
    lines = [
        line for page in PAGES for line in bash_lines(page) if re.search(r"configs/(?!debug)\w+\.toml", line)
    ]
    bare = [
        line
        for line in lines
        if shlex.split(line)[1] in checked
        and "--data.sources=" not in line
        and "allow_small=true" not in line
    ]
    assert lines and not bare, bare


def _plan_of_launch(line: str) -> str:
    """`relaytrain plan` of a documented launch of a preset: the same config, nodes, GPUs and overrides,
    on an H100, with the user's data left out (it is not here)."""
    words = [w for w in shlex.split(line) if not w.startswith("--data.")]
    words[1] = "plan"
    return shlex.join([*words, "--gpu", "h100", "--data.allow_small=true"])


def test_the_plan_lines_and_every_preset_launchs_layout_plan(capsys, monkeypatch):
    """Every `relaytrain plan` of the pages that needs no data of the user's runs and gives a verdict, and
    so does the plan of every launch of a preset the pages show (a node range whose batch does not split
    over one of its counts fails here). The lines run through the `relaytrain` command's own entry
    (`relaytrain.cli:main`, pyproject's script) in this process: plan starts no training, and eleven
    interpreters would import torch eleven times; `relaytrain` as a command is run by the other pages'
    tests."""
    from relaytrain.cli import main

    lines = [line for page in PAGES for line in bash_lines(page)]
    plans = [line for line in lines if line.startswith("relaytrain plan ") and "allow_small=true" in line]
    launches = [line for line in lines if line.startswith("relaytrain launch configs/")]
    assert len(plans) >= 3 and len(launches) >= 5
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # as child_env gives the other lines
    for line in dict.fromkeys([*plans, *map(_plan_of_launch, launches)]):
        assert not set("|&;<>$`") & set(line), f"not one command: {line}"
        code = main(shlex.split(line)[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{line}\nexit {code}\n{out[-3000:]}{err[-3000:]}"
        assert "verdict:" in out, line


def test_where_the_time_went_runs_as_written(tmp_path, stopped_and_resumed_run):
    """status, status --json, report and verify of the page, in a directory whose runs/8b is a tiny stopped
    and resumed run; verify says OK. On the same run, slow-node.md's `logs 8b` (its `status 8b` and
    `report 8b` are this page's lines) shows the run's log to its end."""
    from test_howto_slurm import howto_line

    _copy_run(stopped_and_resumed_run, tmp_path)
    lines = bash_lines(HOWTO / "where-the-time-went.md")
    assert {shlex.split(line)[1] for line in lines} == {"status", "report", "verify"}
    out = {line: _run(line, tmp_path).stdout for line in lines}
    (verify,) = [line for line in lines if line.startswith("relaytrain verify ")]
    assert out[verify].splitlines()[-1] == "verify runs/8b: OK"
    assert (tmp_path / "runs" / "8b" / "report" / "report.md").is_file()
    logs = _run(howto_line("slow-node.md", "relaytrain logs 8b"), tmp_path).stdout
    assert "event finished at step 6" in logs, logs[-2000:]


def test_export_runs_as_written(tmp_path, stopped_and_resumed_run):
    """The export page's commands on a tiny run: the HF export that transformers loads, the torch file, and
    import-hf back (the 8B training line is only parsed)."""
    needs.module("transformers")
    _copy_run(stopped_and_resumed_run, tmp_path)
    page = HOWTO / "export-to-hugging-face.md"
    lines = [line for line in bash_lines(page) if "configs/8b.toml" not in line]
    assert len(lines) >= 4
    out = [_run(line, tmp_path).stdout for line in lines]
    assert "llama" in out[1].split()
    assert (tmp_path / "hf-8b" / "config.json").is_file() and (tmp_path / "model-8b.pt").is_file()
    assert (tmp_path / "ckpt-8b").is_dir()


def _llama3_sized_tokenizer(path: Path) -> None:
    """A tokenizer.json of Llama 3's size (128,256 ids) whose words are w0, w1, ...: what the page's
    tokenizer is to the data rule, without a download."""
    needs.module("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128_254)}}
    vocab |= {"<|begin_of_text|>": 128_254, "<|end_of_text|>": 128_255}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_the_train_page_runs_on_a_corpus_of_its_own(tmp_path):
    """The train page's prepare-data, plan and launch lines, as written, in a directory holding corpus.jsonl
    and a tokenizer.json of Llama 3's size: the data it prepares is the one plan and launch read, and its
    vocabulary fills the 8B model. A corpus of 60,000 tokens cannot feed 100,000 steps, so plan as written
    stops on the epochs alone; with one step it gives a verdict, and launch --dry-run writes the job."""
    import json

    (tmp_path / "configs").symlink_to(REPO / "configs")
    _llama3_sized_tokenizer(tmp_path / "tokenizer.json")
    docs = [{"text": " ".join(f"w{(7 * i + j) % 5000 + 1}" for j in range(200))} for i in range(300)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    lines = bash_lines(HOWTO / "train-on-your-data.md")
    (prepare,) = [line for line in lines if line.startswith("relaytrain prepare-data ")]
    (plan,) = [line for line in lines if line.startswith("relaytrain plan ")]
    (launch,) = [line for line in lines if line.startswith("relaytrain launch ")]
    assert "vocab 128256" in _run(prepare, tmp_path).stdout
    refused = subprocess.run(["bash", "-c", plan], cwd=tmp_path, env=child_env(), capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "epochs, over the 100 allowed" in refused.stderr, refused.stderr
    assert "vocab_size" not in refused.stderr and "data.sources holds about" in refused.stderr
    assert "verdict:" in _run(f"{plan} --train.max_steps=1", tmp_path).stdout
    _run(f"{launch} --train.max_steps=1 --dry-run", tmp_path)
    config = (tmp_path / "runs" / "8b" / "slurm" / "config.toml").read_text()
    assert f'"{tmp_path / "data" / "mine"}"' in config and f'"{tmp_path / "tokenizer.json"}"' in config
