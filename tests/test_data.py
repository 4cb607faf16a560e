"""Tokenizers, prepare-data for every input format, the shard format, and bad-input errors."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from relaytrain.data.commands import register
from relaytrain.data.prepare import is_val_document, prepare_dataset
from relaytrain.data.shards import PreparedDataset
from relaytrain.data.tokenizer import build_tokenizer, tokenizer_name
from relaytrain.errors import UserError

import needs

DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog, naïve café №{i * 7}." for i in range(40)]
DOCS[3] = "A document\nwith two lines."


def train_bpe(path: Path, vocab_size: int = 320, specials=("<s>", "</s>")) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    tok.save(str(path))
    return path


def decoded_split(out: Path, split: str) -> list[str]:
    """The documents stored in a split, decoded with the dataset's own tokenizer."""
    ds = PreparedDataset(out)
    stream = ds.split(split)
    tokens = stream.read(0, stream.num_tokens) if stream.num_tokens else np.zeros(0, dtype=ds.dtype)
    tok = build_tokenizer(str(ds.tokenizer_file) if ds.tokenizer_file else "byte")
    ends = np.flatnonzero(tokens == ds.eos_id)
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1, "every document ends with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def expected_split(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    train = [d for i, d in enumerate(docs) if not is_val_document(i, val_fraction)]
    val = [d for i, d in enumerate(docs) if is_val_document(i, val_fraction)]
    return train, val


def assert_round_trip(out: Path, docs: list[str], val_fraction: float) -> None:
    train, val = expected_split(docs, val_fraction)
    assert val, "the test corpus is large enough to have validation documents"
    assert decoded_split(out, "train") == train
    assert decoded_split(out, "val") == val


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte")
    text = "héllo wörld ✓ \n\t 🚀"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.name) == (258, 256, 257, "byte")
    assert tok.decode(ids + [tok.eos_id]) == text


def test_hf_tokenizer_round_trip_and_name(tmp_path):
    path = train_bpe(tmp_path / "tokenizer.json")
    tok = build_tokenizer(str(path))
    for text in DOCS[:5] + ["unseen wörds ✓ 🚀 mixed"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.name.startswith("file:") and len(tok.name) == 5 + 16
    assert tok.name == tokenizer_name(str(path)) == build_tokenizer(str(tmp_path)).name  # dir form
    assert tok.eos_id == tok._tok.token_to_id("</s>") and tok.bos_id == tok._tok.token_to_id("<s>")
    assert tok.vocab_size == 320


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        build_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="no end-of-text token"):
        build_tokenizer(str(train_bpe(tmp_path / "noeos.json", specials=("<pad>",))))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        build_tokenizer(str(tmp_path / "bad.json"))


def test_prepare_txt_byte(tmp_path):
    # Two files; blank lines (also with spaces, and runs of them) separate documents.
    (tmp_path / "a.txt").write_text("\n\n".join(DOCS[:20]) + "\n")
    (tmp_path / "b.txt").write_text("\n\n  \n\n".join(DOCS[20:]))
    out = prepare_dataset(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "out", val_fraction=0.1
    )
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["tokenizer"], meta["eos_id"]) == (
        "uint16",
        258,
        "byte",
        257,
    )
    assert meta["splits"]["train"]["documents"] == 36 and meta["splits"]["val"]["documents"] == 4
    assert not (out / "tokenizer.json").exists() and meta["tokenizer_file"] is None
    assert_round_trip(out, DOCS, 0.1)
    assert not list(tmp_path.glob(".out.tmp-*")), "the temporary directory is renamed into place"


def test_prepare_jsonl_gz_with_hf_tokenizer_and_small_shards(tmp_path):
    tok_path = train_bpe(tmp_path / "tok.json")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        for i, d in enumerate(DOCS):
            f.write(json.dumps({"id": i, "body": d}) + "\n\n")
    out = prepare_dataset(
        [str(tmp_path / "d.jsonl.gz")],
        tmp_path / "out",
        tokenizer=str(tok_path),
        text_key="body",
        val_fraction=0.1,
        shard_tokens=100,
    )
    ds = PreparedDataset(out)
    assert ds.tokenizer_name == tokenizer_name(str(tok_path)) and ds.vocab_size == 320
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    shards = ds.meta["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["tokens"] == 100 for s in shards[:-1])
    assert sum(s["tokens"] for s in shards) == ds.split("train").num_tokens
    assert_round_trip(out, DOCS, 0.1)  # reads cross shard boundaries


def test_prepare_parquet_and_saved_dataset(tmp_path):
    pa = needs.module("pyarrow")
    pq = needs.module("pyarrow.parquet")
    datasets = needs.module("datasets")
    pq.write_table(pa.table({"content": DOCS[:25], "n": list(range(25))}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"content": DOCS[25:]}).save_to_disk(str(tmp_path / "saved"))
    out = prepare_dataset(
        [str(tmp_path / "a.parquet"), str(tmp_path / "saved")],
        tmp_path / "out",
        text_key="content",
        val_fraction=0.1,
    )
    assert_round_trip(out, DOCS, 0.1)
    # A DatasetDict contributes every split, in split-name order.
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
            "test": datasets.Dataset.from_dict({"text": DOCS[30:]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    out2 = prepare_dataset([str(tmp_path / "dd")], tmp_path / "out2", val_fraction=0.1)
    assert_round_trip(out2, DOCS[30:] + DOCS[:30], 0.1)


def test_cli_workers_give_identical_shards_and_directory_inputs(tmp_path, capsys):
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("\n\n".join(DOCS[:10]))
    (src / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[10:]))
    (src / "notes.md").write_text("ignored: not a supported extension")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        args = parser.parse_args(
            ["prepare-data", str(src), "--out", str(out), "--workers", str(workers), "--val-fraction", "0.1"]
        )
        assert args.func(args) == 0
        outs.append(out)
    assert "prepared" in capsys.readouterr().out
    assert_round_trip(outs[0], DOCS, 0.1)
    for name in ("train-00000.bin", "val-00000.bin", "meta.json"):
        assert (outs[0] / name).read_bytes().replace(b"out1", b"out2") == (outs[1] / name).read_bytes()


def test_large_vocab_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text("w69999 w1 w65536\n\nw2 w3")
    out = prepare_dataset(
        [str(tmp_path / "t.txt")], tmp_path / "out", tokenizer=str(tmp_path / "big.json"), val_fraction=0.0
    )
    ds = PreparedDataset(out)
    assert ds.meta["dtype"] == "uint32" and ds.vocab_size == 70_002
    assert ds.split("train").read(0, 7).tolist() == [69999, 1, 65536, 70001, 2, 3, 70001]


def test_bad_inputs_raise_user_errors(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("\n\n".join(DOCS))
    cases = [
        ([str(tmp_path / "missing.txt")], {}, "does not exist"),
        ([str(tmp_path / "x.csv")], {}, "unsupported type"),
        ([], {}, "no inputs"),
        ([str(good)], {"val_fraction": 1.0}, "val-fraction"),
        ([str(good)], {"workers": 0}, "--workers"),
        ([str(good)], {"tokenizer": str(tmp_path / "nope.json")}, "does not exist"),
    ]
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    cases.append(([str(tmp_path / "empty.txt")], {}, "no training text"))
    (tmp_path / "emptydir").mkdir()
    cases.append(([str(tmp_path / "emptydir")], {}, "has no .txt"))
    (tmp_path / "badkey.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    cases.append(([str(tmp_path / "badkey.jsonl")], {}, r"badkey.jsonl:2: no 'text' field \(found: body\)"))
    (tmp_path / "badjson.jsonl").write_text('{"text": "ok"}\n{oops\n')
    cases.append(([str(tmp_path / "badjson.jsonl")], {}, "badjson.jsonl:2: invalid JSON"))
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    cases.append(([str(tmp_path / "num.jsonl")], {}, "is int, not text"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases.append(([str(tmp_path / "latin1.txt")], {}, "not valid UTF-8"))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
        cases.append(([str(tmp_path / "nocol.parquet")], {}, r"no column 'text' \(columns: body\)"))
        (tmp_path / "corrupt.parquet").write_bytes(b"not parquet")
        cases.append(([str(tmp_path / "corrupt.parquet")], {}, "cannot read parquet"))
    except ImportError:
        pass
    for i, (inputs, kwargs, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            prepare_dataset(inputs, tmp_path / f"out{i}", **kwargs)
        assert not (tmp_path / f"out{i}").exists(), "a failed run leaves nothing at --out"
    assert not list(tmp_path.glob(".out*.tmp-*")), "temporary directories are removed on failure"
    prepare_dataset([str(good)], tmp_path / "done")
    with pytest.raises(UserError, match="already exists"):
        prepare_dataset([str(good)], tmp_path / "done")
    assert prepare_dataset([str(good)], tmp_path / "done", exist_ok=True) == tmp_path / "done"


def test_damaged_or_foreign_directories_are_rejected(tmp_path):
    with pytest.raises(UserError, match="not a prepared dataset directory.*relaytrain prepare-data"):
        PreparedDataset(tmp_path)
    (tmp_path / "good.txt").write_text("\n\n".join(DOCS))
    out = prepare_dataset([str(tmp_path / "good.txt")], tmp_path / "out")
    shard = out / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="damaged"):
        PreparedDataset(out)
    (out / "meta.json").write_text('{"format": "something-else"}')
    with pytest.raises(UserError, match="not a relaytrain token dataset"):
        PreparedDataset(out)


@pytest.mark.timeout(120)
def test_failure_while_writing_with_a_pool_cleans_up_without_hanging(tmp_path, monkeypatch):
    from relaytrain.data import prepare

    (tmp_path / "many.txt").write_text("\n\n".join(f"doc {i}" for i in range(40_000)))
    calls = []

    def failing_write(self, tokens, documents):
        calls.append(1)
        if len(calls) > 2:
            raise OSError("No space left on device")

    monkeypatch.setattr(prepare.ShardWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        prepare_dataset([str(tmp_path / "many.txt")], tmp_path / "out", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.txt"]
