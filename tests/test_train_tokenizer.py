"""`relaytrain train-tokenizer`: a byte-level BPE on the user's text whose end-of-text token the data
pipeline finds, bad input in one line, and docs/data.md's path from text to transformers run as written."""

from __future__ import annotations

import gzip
import json
import subprocess

import numpy as np
import pytest

from relaytrain.cli import main
from relaytrain.data.sources import BUNDLED_CORPUS
from relaytrain.data.tokenizer import build_tokenizer
from test_readme import REPO, bash_blocks

from conftest import child_env

PATH_HEADING = "From your own text to Hugging Face"


def write_corpus(folder, paragraphs: int = 3000) -> None:
    """Two .txt files of the bundled corpus's paragraphs (documents separated by blank lines)."""
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        text = f.read().split("\n\n")[:paragraphs]
    folder.mkdir()
    half = len(text) // 2
    (folder / "a.txt").write_text("\n\n".join(text[:half]) + "\n")
    (folder / "b.txt").write_text("\n\n".join(text[half:]) + "\n")


def relaytrain(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text") / "corpus"
    write_corpus(folder, paragraphs=600)
    return folder


def test_the_tokenizer_separates_documents_with_its_end_of_text_token(tmp_path, corpus, capsys):
    out = tmp_path / "tok" / "tokenizer.json"
    code, printed, err = relaytrain(
        capsys, "train-tokenizer", str(corpus), "--vocab-size", "600", "--out", str(out)
    )
    assert code == 0, err
    tok = build_tokenizer(str(out))
    vocab = json.loads(out.read_text())["model"]["vocab"]
    assert tok.vocab_size == 600 and tok.eos_id == vocab["<|endoftext|>"] == 0 and tok.bos_id == tok.eos_id
    assert f"trained {out}: vocab 600, end-of-text <|endoftext|> (id 0)" in printed
    assert tok.decode(tok.encode("naïve café ✓ déjà")) == "naïve café ✓ déjà"  # bytes: nothing unknown
    assert len(tok.encode("the function returns")) < len("the function returns") / 2  # merges learned

    data = tmp_path / "data"
    args = ["prepare-data", str(corpus), "--tokenizer", str(out), "--out", str(data), "--workers", "1",
            "--val-fraction", "0"]  # fmt: skip
    code, printed, err = relaytrain(capsys, *args)
    assert code == 0, err
    meta = json.loads((data / "meta.json").read_text())
    assert meta["eos_id"] == 0 and meta["vocab_size"] == 600
    ids = np.fromfile(data / "train-00000.bin", dtype=meta["dtype"])
    assert (ids == 0).sum() == meta["splits"]["train"]["documents"] == 600  # one EOS after each document


def test_a_begin_token_and_further_special_tokens(tmp_path, corpus, capsys):
    out = tmp_path / "tokenizer.json"
    args = ["train-tokenizer", str(corpus), "--vocab-size", "400", "--out", str(tmp_path),
            "--eos-token", "</s>", "--bos-token", "<s>", "--special-token", "<pad>",
            "--special-token", "<|user|>"]  # fmt: skip
    code, _, err = relaytrain(capsys, *args)
    assert code == 0, err
    tok = build_tokenizer(str(out))
    vocab = json.loads(out.read_text())["model"]["vocab"]
    assert (tok.eos_id, tok.bos_id, vocab["<pad>"], vocab["<|user|>"]) == (0, 1, 2, 3)
    assert tok.encode("<|user|> hi")[0] == 3  # a special token stays whole


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.txt", "--vocab-size", "1000"], "input 'missing.txt' does not exist"),
        (
            ["CORPUS", "--vocab-size", "100"],
            "--vocab-size 100 is too small: a byte-level BPE holds the 256 "
            "byte symbols and 1 special token(s); use at least 258",
        ),  # fmt: skip
        (
            ["CORPUS", "--vocab-size", "259", "--bos-token", "<s>", "--special-token", "<pad>"],
            "--vocab-size 259 is too small: a byte-level BPE holds the 256 byte symbols and 3 special "
            "token(s); use at least 260",
        ),  # fmt: skip
        (
            ["CORPUS", "--vocab-size", "1000", "--eos-token", "<end>"],
            "--eos-token '<end>' is not an end-of-text",
        ),
        (
            ["CORPUS", "--vocab-size", "1000", "--bos-token", "<start>"],
            "--bos-token '<start>' is not a begin",
        ),
        (["CORPUS", "--vocab-size", "1000", "--special-token", "</s>"], "would be read as the end- or begin"),
        (["CORPUS", "--vocab-size", "1000", "--min-frequency", "0"], "--min-frequency must be >= 1, got 0"),
        (["EMPTY", "--vocab-size", "1000"], "no text in"),
        (
            ["CORPUS", "--vocab-size", "1000", "--out", "EXISTING"],
            "already exists; remove it or choose another",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, corpus, capsys, args, message):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    (tmp_path / "existing.json").write_text("{}")
    names = {
        "CORPUS": str(corpus),
        "EMPTY": str(tmp_path / "empty.txt"),
        "EXISTING": str(tmp_path / "existing.json"),
    }
    args = [names.get(a, a) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "tok.json")]
    code, out, err = relaytrain(capsys, "train-tokenizer", *args)
    assert code == 2 and out == "", out
    assert err.count("\n") == 1 and err.startswith("relaytrain: error: ") and message in err, err
    assert not (tmp_path / "tok.json").exists()


def test_the_documented_path_from_text_to_transformers_runs_as_written(tmp_path):
    """docs/data.md's block, as written, in a directory holding the user's text in corpus/."""
    (lines,) = [lines for heading, lines in bash_blocks(REPO / "docs" / "data.md") if heading == PATH_HEADING]
    assert [line.split()[:2] for line in lines[:4]] == [
        ["relaytrain", "train-tokenizer"], ["relaytrain", "prepare-data"], ["relaytrain", "train"],
        ["relaytrain", "export"],
    ]  # fmt: skip
    assert "transformers" in lines[4]
    write_corpus(tmp_path / "corpus")
    done = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    vocab = build_tokenizer(str(tmp_path / "tok" / "tokenizer.json")).vocab_size
    assert vocab == 2000
    assert done.stdout.strip().splitlines()[-1] == f"torch.Size([1, 3, {vocab}])"
    assert (tmp_path / "hf/mine/tokenizer.json").read_bytes() == (
        tmp_path / "tok/tokenizer.json"
    ).read_bytes()
