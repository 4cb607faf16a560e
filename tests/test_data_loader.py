"""The global sampler, mixtures, train/val loaders, source resolution and the bundled corpus."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from relaytrain.config.schema import Config
from relaytrain.data import build_train_loader, build_val_loader, resolve_sources
from relaytrain.data.prepare import is_val_document, prepare_dataset
from relaytrain.data.sampler import Mixture, WindowOrder
from relaytrain.data.shards import PreparedDataset
from relaytrain.data.sources import bundled_cache_dir, prepare_bundled
from relaytrain.errors import UserError

DOCS_A = [f"alpha document {i} " + "lorem ipsum " * (i % 7) for i in range(300)]
DOCS_B = [f"BETA {i}: " + "dolor sit amet " * (i % 5) for i in range(200)]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sources")
    outs = []
    for name, docs in (("a", DOCS_A), ("b", DOCS_B)):
        (root / f"{name}.txt").write_text("\n\n".join(docs))
        outs.append(prepare_dataset([str(root / f"{name}.txt")], root / name, val_fraction=0.05))
    return outs


def make_cfg(tmp_path: Path, sources: list[Path] | None = None, **train) -> Config:
    cfg = Config()
    cfg.run.dir = str(tmp_path / "runs")
    cfg.data.sources = [str(s) for s in sources or []]
    cfg.train.seq_len = train.get("seq_len", 16)
    cfg.train.global_batch_size = train.get("global_batch_size", 8)
    return cfg


def train_loader(cfg: Config, dp_rank: int, dp_size: int, local_batch_size: int):
    return build_train_loader(
        cfg.data,
        dp_rank,
        dp_size,
        local_batch_size,
        seq_len=cfg.train.seq_len,
        seed=cfg.run.seed,
        vocab_size=cfg.model.vocab_size,
        runs_dir=cfg.run.dir,
    )


def val_loader(cfg: Config, dp_rank: int, dp_size: int):
    return build_val_loader(
        cfg.data,
        dp_rank,
        dp_size,
        seq_len=cfg.train.seq_len,
        vocab_size=cfg.model.vocab_size,
        runs_dir=cfg.run.dir,
    )


def sources_of(cfg: Config) -> list[Path]:
    return resolve_sources(cfg.data, vocab_size=cfg.model.vocab_size, runs_dir=cfg.run.dir)


def global_sequence(cfg: Config, dp_size: int, steps: int, state: dict | None = None):
    """Each step's global batch (ranks concatenated in order) and the final state, for ``dp_size`` ranks."""
    local = cfg.train.global_batch_size // dp_size
    loaders = [train_loader(cfg, r, dp_size, local) for r in range(dp_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    batches = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        assert all(p[0].shape == (cfg.train.global_batch_size // dp_size, cfg.train.seq_len) for p in parts)
        batches.append(torch.cat([p[0] for p in parts]))
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "every rank holds the same global state"
    return batches, states[0]


def test_unshuffled_epoch_reproduces_the_token_stream(tmp_path, two_sources):
    cfg = make_cfg(tmp_path, two_sources[:1], seq_len=16, global_batch_size=4)
    cfg.data.shuffle = False
    loader = train_loader(cfg, 0, 1, cfg.train.global_batch_size)
    windows = loader.samples_per_epoch[0]
    inputs, targets = loader.global_samples(0, windows)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs[1:, 0], targets[:-1, -1]), "windows share only their boundary token"
    tokens = np.concatenate([inputs.reshape(-1).numpy(), targets[-1, -1:].numpy()])
    assert len(tokens) > PreparedDataset(two_sources[0]).num_tokens("train") - 16
    # Decoded at EOS boundaries, the epoch is the training documents in order (the last one cut short).
    pieces = np.split(tokens, np.flatnonzero(tokens == 257) + 1)
    decoded = [loader.tokenizer.decode(p.tolist()) for p in pieces]
    train_docs = [d for i, d in enumerate(DOCS_A) if not is_val_document(i, 0.05)]
    assert decoded[:-1] == train_docs[: len(decoded) - 1]
    assert train_docs[len(decoded) - 1].startswith(decoded[-1])
    assert loader.samples_consumed == 0 and loader.next_batch()[0].tolist() == inputs[:4].tolist()


def test_shuffled_epochs_visit_every_window_once(tmp_path, two_sources):
    order = WindowOrder(num_windows=50, seed=3, source=0, shuffle=True)
    first, second = order.windows(np.arange(50)), order.windows(np.arange(50, 100))
    assert sorted(first.tolist()) == list(range(50)) == sorted(second.tolist())
    assert first.tolist() != second.tolist() != list(range(50))
    assert order.windows(np.array([123, 7])).tolist() == [order.windows(np.arange(150))[123], first[7]]
    other_seed = WindowOrder(50, seed=4, source=0, shuffle=True).windows(np.arange(50))
    assert other_seed.tolist() != first.tolist()


def test_same_global_sequence_for_any_dp_size_and_across_resume(tmp_path, two_sources):
    cfg = make_cfg(tmp_path, two_sources, seq_len=16, global_batch_size=8)
    cfg.data.weights = [3.0, 1.0]
    cfg.run.seed = 11
    reference, _ = global_sequence(cfg, 1, steps=40)  # 320 samples: wraps source b's epoch (about 150)
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(reference, global_sequence(cfg, dp, 40)[0], strict=True))
    # Save after 15 steps on 2 ranks, resume on 4 ranks and on 1 rank: the sequence continues unchanged.
    _, state = global_sequence(cfg, 2, steps=15)
    assert state["samples_consumed"] == 15 * 8 and state["seed"] == 11
    for dp in (4, 1):
        resumed, final = global_sequence(cfg, dp, steps=25, state=state)
        assert all(torch.equal(a, b) for a, b in zip(reference[15:], resumed, strict=True))
        assert final["samples_consumed"] == 40 * 8
    # The saved seed wins over the config's seed on resume.
    cfg.run.seed = 99
    resumed, _ = global_sequence(cfg, 2, steps=5, state=state)
    assert all(torch.equal(a, b) for a, b in zip(reference[15:20], resumed, strict=True))


def test_mixture_honours_weights_and_is_random_access():
    weights = [1.0, 2.0, 7.0]
    mix = Mixture(weights)
    n = mix.block * 20
    source, local = mix.assign(np.arange(n))
    counts = np.bincount(source, minlength=3)
    assert np.all(np.abs(counts - n * np.array(weights) / 10) <= 1)
    for s in range(3):  # each source's samples are its indices 0, 1, 2, ... in order
        assert local[source == s].tolist() == list(range(counts[s]))
    for k in range(1, 20):  # the blend is within one sample of the weights at every block boundary
        c = np.bincount(source[: k * mix.block], minlength=3)
        assert np.all(np.abs(c - k * mix.block * np.array(weights) / 10) <= 1)
    # Smooth inside a block too: any 100 consecutive samples hold roughly 10/20/70.
    window = np.bincount(source[5000:5100], minlength=3)
    assert np.all(np.abs(window - np.array([10, 20, 70])) <= 2)
    # Any index can be computed without the history, by a fresh instance.
    probe = np.array([n - 1, 17, 10**12 + 5])
    fresh_source, fresh_local = Mixture(weights).assign(probe)
    assert fresh_source[:2].tolist() == source[probe[:2]].tolist()
    assert fresh_local[:2].tolist() == local[probe[:2]].tolist()
    assert abs(fresh_local[2] - (10**12) * weights[fresh_source[2]] / 10) < mix.block
    tiny = Mixture([1.0, 1e-4])
    s, _ = tiny.assign(np.arange(tiny.block * 3))
    assert np.bincount(s).tolist() == [tiny.block * 3 - 6, 6]


def test_mixture_in_the_loader_draws_each_source_by_weight(tmp_path, two_sources):
    cfg = make_cfg(tmp_path, two_sources, seq_len=16, global_batch_size=64)
    cfg.data.weights = [1.0, 3.0]
    loader = train_loader(cfg, 0, 1, cfg.train.global_batch_size)
    inputs, _ = loader.next_batch()
    from_b = sum("BETA" in text or "dolor" in text for text in map(loader.tokenizer.decode, inputs.tolist()))
    assert 40 <= from_b <= 56  # 48 expected; a window of "lorem ipsum" text never mentions BETA/dolor


def test_val_batches_are_fixed_and_rank_sharded(tmp_path, two_sources, caplog):
    cfg = make_cfg(tmp_path, two_sources, seq_len=16)
    one = list(val_loader(cfg, 0, 1).batches(3, 4))
    assert [b[0].shape for b in one] == [(4, 16)] * 3
    again = list(val_loader(cfg, 0, 1).batches(3, 4))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, again, strict=True))
    ranks = [list(val_loader(cfg, r, 2).batches(3, 2)) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([ranks[0][b][0], ranks[1][b][0]]), one[b][0])
    # Validation text is the val split, not training text.
    ds = PreparedDataset(two_sources[0])
    val_tokens = ds.split("val").read(0, ds.split("val").num_tokens).tolist()
    row = one[0][0][0].tolist()
    assert any(val_tokens[i : i + 16] == row for i in range(len(val_tokens) - 15))
    # No usable val split: the tail of the training split, with a warning.
    (tmp_path / "t.txt").write_text("\n\n".join(DOCS_A))
    no_val = prepare_dataset([str(tmp_path / "t.txt")], tmp_path / "noval", val_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="relaytrain.data"):
        batches = list(val_loader(make_cfg(tmp_path, [no_val]), 0, 1).batches(2, 2))
    assert "no validation split" in caplog.text and batches[0][0].shape == (2, 16)


def test_bundled_corpus_resolves_and_yields_batches(tmp_path):
    cfg = make_cfg(tmp_path, None, seq_len=64, global_batch_size=8)
    (path,) = sources_of(cfg)
    assert path == bundled_cache_dir(cfg.data, cfg.run.dir) and path.parent == tmp_path / "runs" / ".cache"
    ds = PreparedDataset(path)
    assert ds.tokenizer_name == "byte" and ds.num_tokens("train") > 800_000 and ds.num_tokens("val") > 10_000
    loader = train_loader(cfg, 0, 2, cfg.train.global_batch_size // 2)
    inputs, targets = loader.next_batch()
    assert inputs.shape == targets.shape == (4, 64) and inputs.dtype == torch.long
    text = loader.tokenizer.decode(inputs[0].tolist())
    assert sum(c.isalpha() or c == " " for c in text) > 0.8 * len(text), "English text"
    assert sources_of(cfg) == [path], "prepared once, then reused"


def _prepare_bundled_in_child(run_dir: str, queue) -> None:
    cfg = Config()
    cfg.run.dir = run_dir
    queue.put(str(prepare_bundled(cfg.data, cfg.run.dir)))


def test_bundled_corpus_is_safe_when_ranks_start_together(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare_bundled_in_child, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    (path,) = paths
    PreparedDataset(path)
    assert [p.name for p in (tmp_path / ".cache").iterdir() if ".tmp-" in p.name] == []


def test_source_errors_name_the_problem(tmp_path, two_sources):
    from test_data import train_bpe

    cfg = make_cfg(tmp_path, [tmp_path / "not-prepared"])
    with pytest.raises(UserError, match=r"not-prepared is not a prepared dataset.*relaytrain prepare-data"):
        sources_of(cfg)
    cfg = make_cfg(tmp_path, two_sources)
    cfg.model.vocab_size = 200
    with pytest.raises(UserError, match=r"vocab_size 258 but model.vocab_size is 200"):
        sources_of(cfg)
    cfg = make_cfg(tmp_path, two_sources)
    cfg.data.tokenizer = str(train_bpe(tmp_path / "tok.json"))
    with pytest.raises(UserError, match=r"prepared with tokenizer 'byte'.*set data.tokenizer = \"byte\""):
        sources_of(cfg)
    cfg.data.tokenizer = str(tmp_path / "missing.json")
    with pytest.raises(UserError, match="does not exist"):
        sources_of(cfg)
    cfg = make_cfg(tmp_path, two_sources)
    cfg.data.weights = [1.0]
    with pytest.raises(UserError, match="data.weights has 1 entries"):
        sources_of(cfg)
    too_short = make_cfg(tmp_path, two_sources, seq_len=100_000)
    with pytest.raises(UserError, match="fewer than train.seq_len"):
        train_loader(too_short, 0, 1, too_short.train.global_batch_size)
    with pytest.raises(UserError, match="fewer than train.seq_len"):
        val_loader(too_short, 0, 1)


def test_hf_tokenized_source_with_matching_config(tmp_path):
    from test_data import DOCS, train_bpe

    tok = train_bpe(tmp_path / "tok.json")
    (tmp_path / "d.txt").write_text("\n\n".join(DOCS * 5))
    out = prepare_dataset([str(tmp_path / "d.txt")], tmp_path / "out", tokenizer=str(tok))
    cfg = make_cfg(tmp_path, [out], seq_len=8, global_batch_size=2)
    with pytest.raises(UserError, match=f"set data.tokenizer to {out / 'tokenizer.json'}"):
        sources_of(cfg)
    cfg.data.tokenizer = str(out / "tokenizer.json")  # the copy kept in the prepared directory
    loader = train_loader(cfg, 0, 1, cfg.train.global_batch_size)
    inputs, _ = loader.next_batch()
    assert inputs.max() < 320 and loader.tokenizer.vocab_size == 320
