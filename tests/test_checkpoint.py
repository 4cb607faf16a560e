"""CheckpointManager (the persistence front's DCP tier) in one process: round trips, async commit,
latest, retention, failures, schedule."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relaytrain import torch_private
from relaytrain.checkpoint import Persistence, RngState, RunRecord, TrainingState, checksums, choose, files
from relaytrain.checkpoint.schedule import SaveSchedule, retention_victims
from relaytrain.checkpoint.state import merged_view
from relaytrain.config import Config, config_hash, config_to_toml
from relaytrain.config.schema import CheckpointConfig, ModelConfig
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.model import Transformer

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


class State:
    """The trainer's train state in miniature: step and a data position (the manager owns the RNG)."""

    def __init__(self):
        self.step, self.position = 0, 0

    def state_dict(self):
        return {"step": self.step, "position": self.position}

    def load_state_dict(self, d):
        self.step, self.position = d["step"], d["position"]


def make(tmp_path: Path, **kwargs):
    """The DCP tier of a one-process front (see `make_front`), the model parts, optimizer and state."""
    front, *rest = make_front(tmp_path, **kwargs)
    return (front.checkpoints, *rest)


def make_front(
    tmp_path: Path,
    seed: int = 0,
    model: dict | None = None,
    parts: int = 1,
    tokenizer: str = "byte",
    **ckpt,
):
    cfg = Config()
    cfg.model = ModelConfig(**(model or SMALL))
    cfg.data.tokenizer = tokenizer
    for key, value in ckpt.items():
        setattr(cfg.checkpoint, key, value)
    torch.manual_seed(seed)
    full = Transformer(cfg.model)
    full.init_weights(seed=seed)
    model_parts = split(full, parts) if parts > 1 else [full]
    opt = torch.optim.AdamW([p for m in model_parts for p in m.parameters()], lr=1e-2)
    state = State()
    record = RunRecord("run", config_to_toml(cfg), config_hash(cfg), cfg.model, tokenizer)
    front = Persistence(
        cfg.checkpoint,
        RunDir(tmp_path / "run"),
        record,
        TrainingState(model_parts, [opt], {"train_state": state, "rng": RngState(cfg.run.seed)}),
        rank=0,
        world_size=1,
        parallel_dims={"pp": parts},
    )
    return front, model_parts, opt, state


def split(model: Transformer, parts: int) -> list[Transformer]:
    """Two pipeline-style stages that share the global parameter names (layers keep their index)."""
    import copy

    first, second = copy.deepcopy(model), copy.deepcopy(model)
    half = model.cfg.n_layers // 2
    for i in range(half, model.cfg.n_layers):
        del first.layers[str(i)]
    for i in range(half):
        del second.layers[str(i)]
    first.norm = first.output = None
    second.tok_embeddings = None
    return [first, second]


def forward(parts, tokens):
    h = tokens
    for part in parts:
        h = part(h)
    return h


def train_step(parts, opt, state, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    noise = torch.rand(()).item()  # consumes the global RNG so a wrong RNG restore shows in the loss
    loss = torch.nn.functional.cross_entropy(
        forward(parts, tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()
    )
    (loss * (1 + 1e-3 * noise)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.step += 1
    state.position += 2
    return loss.item()


def params(parts) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for part in parts for k, v in part.state_dict().items()}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_is_bit_exact(tmp_path, mode):
    mgr, parts, opt, state = make(tmp_path, mode=mode)
    assert mgr.load() is None
    for _ in range(3):
        train_step(parts, opt, state, state.step)
    mgr.save(3)
    mgr.wait()
    expected = [train_step(parts, opt, state, state.step) for _ in range(3)]

    mgr2, parts2, opt2, state2 = make(tmp_path, seed=1, mode=mode)
    assert mgr2.load() == 3
    assert (state2.step, state2.position) == (3, 6)
    assert [train_step(parts2, opt2, state2, state2.step) for _ in range(3)] == expected
    meta = json.loads((tmp_path / "run/checkpoints/step_3/metadata.json").read_text())
    assert (
        meta["step"] == 3
        and meta["world_size"] == 1
        and meta["contents"] == ["model", "optimizer", "train_state"]
    )


def test_async_save_snapshots_state_before_training_continues(tmp_path):
    mgr, parts, opt, state = make(tmp_path, mode="async")
    train_step(parts, opt, state, 0)
    before = params(parts)
    mgr.save(1)
    train_step(parts, opt, state, 1)  # changes the weights while the save may still be writing
    for _ in range(2000):
        mgr.poll()
        if (tmp_path / "run/checkpoints/latest").is_symlink():
            break
        import time

        time.sleep(0.01)
    assert (tmp_path / "run/checkpoints/step_1/COMPLETE").is_file()
    mgr2, parts2, _, _ = make(tmp_path, seed=3)
    assert mgr2.load() == 1
    after = params(parts2)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("closes", [False, True], ids=["stager-kept", "stager-closed-after-stage"])
def test_async_saves_of_state_off_the_host_copy_it_every_time(tmp_path, monkeypatch, closes):
    """State off the host (a GPU's) is copied by DCP's stager at each async save. torch 2.11's stager
    closes itself after every stage (torch 2.13's does not): a second save with it fails, so the manager
    takes a new one. Forced here on CPU: the state claims to be off the host."""
    from torch.distributed.checkpoint import staging

    monkeypatch.setattr(TrainingState, "on_host", lambda self: False)
    if closes:
        stage = staging.DefaultStager._stage

        def stage_then_close(self, state_dict, **kwargs):  # torch 2.11's DefaultStager._stage
            staged = stage(self, state_dict, **kwargs)
            self._state_dict_stager.close()
            return staged

        monkeypatch.setattr(staging.DefaultStager, "_stage", stage_then_close)
    mgr, parts, opt, state = make(tmp_path, mode="async")
    first = mgr._stager
    saved = {}
    for step in (1, 2, 3):
        train_step(parts, opt, state, step - 1)
        saved[step] = params(parts)
        mgr.save(step)
        mgr.wait()
    # kept where torch keeps it (its host buffers are reused); torch 2.11 closes it after every stage
    probe = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    probe.stage({"w": torch.zeros(2)})
    keeps = not closes and torch_private.stager_reusable(probe)
    assert (mgr._stager is first) is keeps
    for step in (1, 2, 3):
        front, parts2, _, _ = make_front(
            tmp_path, seed=9, resume=str(tmp_path / f"run/checkpoints/step_{step}")
        )
        assert front.checkpoints.load() == step
        assert all(torch.equal(saved[step][k], v) for k, v in params(parts2).items())


def test_initial_save_keeps_optimizer_untouched(tmp_path):
    mgr, parts, opt, state = make(tmp_path, save_initial=True)
    assert mgr.should_save(0, False)
    mgr.save(0, reason="initial")
    assert not opt.state  # asking DCP for optimizer state would have created step-1 moments
    meta = files.read_metadata(tmp_path / "run/checkpoints/step_0")
    assert meta["contents"] == ["model", "train_state"] and meta["reason"] == "initial"
    expected = train_step(parts, opt, state, 0)
    mgr2, parts2, opt2, state2 = make(tmp_path, seed=5)
    assert mgr2.load() == 0
    assert train_step(parts2, opt2, state2, 0) == expected


def test_latest_is_an_atomic_symlink_to_the_newest(tmp_path):
    mgr, parts, opt, state = make(tmp_path, keep_last=0)
    for step in (1, 2):
        train_step(parts, opt, state, step)
        mgr.save(step)
    ckpt = tmp_path / "run/checkpoints"
    assert (ckpt / "latest").is_symlink() and os.readlink(ckpt / "latest") == "step_2"
    assert not any(p.name.endswith(".tmp") for p in ckpt.iterdir())
    mgr.save(2, reason="stop")  # same step again: nothing new
    assert [e.step for e in files.list_steps(ckpt)] == [1, 2]


def test_retention_keeps_last_and_every(tmp_path):
    mgr, parts, opt, state = make(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 8):
        train_step(parts, opt, state, step)
        mgr.save(step)
    mgr.wait()  # old checkpoints are deleted in the background
    assert [e.step for e in files.list_steps(tmp_path / "run/checkpoints")] == [4, 6, 7]


def test_retention_never_deletes_latest_or_protected():
    def entry(step, complete=True):
        return files.StepEntry(step, Path(f"/c/step_{step}"), complete)

    entries = [entry(1), entry(2), entry(3, False), entry(4), entry(5), entry(6, False)]
    victims = retention_victims(entries, Path("/c/step_1"), 1, 0, protected={Path("/c/step_2")})
    # 1 is latest, 2 is being written, 5 is the newest complete; 6 is newer than it (maybe in flight).
    assert [v.step for v in victims] == [3, 4]
    assert retention_victims([entry(1, False)], None, 1, 0, set()) == []


def test_interrupted_save_leaves_previous_checkpoint_loaded(tmp_path, caplog):
    mgr, parts, opt, state = make(tmp_path)
    train_step(parts, opt, state, 0)
    mgr.save(1)
    ckpt = tmp_path / "run/checkpoints"
    partial = ckpt / "step_9"
    (partial / "train_state").mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half written")
    mgr2, _, _, state2 = make(tmp_path, seed=2)
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
        assert mgr2.load() == 1
    assert "skipping incomplete checkpoint" in caplog.text and "step_9" in caplog.text
    # latest pointing at an incomplete dir (a crash between swap and a later deletion) is not trusted
    files.point_latest(ckpt, partial)
    assert choose.choose_resume(ckpt)[0] == ckpt / "step_1"


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import torch.distributed.checkpoint.filesystem as fs
    import test_checkpoint as t

    mgr, parts, opt, state = t.make(Path({tmp!r}))
    t.train_step(parts, opt, state, 0)
    mgr.save(1)
    t.train_step(parts, opt, state, 1)
    # die the moment the shards are on disk, before DCP's .metadata and our COMPLETE marker
    fs._FileSystemWriter.finish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    mgr.save(2)
    """
)


def test_killed_save_process_leaves_previous_checkpoint(tmp_path):
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpt = tmp_path / "run/checkpoints"
    assert (ckpt / "step_2/__0_0.distcp").is_file() and not (ckpt / "step_2/COMPLETE").exists()
    mgr, parts, opt, state = make(tmp_path, seed=4)
    assert mgr.load() == 1
    train_step(parts, opt, state, 1)
    mgr.save(2)  # replaces the leftover
    train_step(parts, opt, state, 2)
    mgr.save(3)
    assert [(e.step, e.complete) for e in files.list_steps(ckpt)] == [(1, True), (2, True), (3, True)]


def test_shape_mismatch_lists_the_tensors(tmp_path):
    mgr, parts, opt, state = make(tmp_path)
    train_step(parts, opt, state, 0)
    mgr.save(1)
    bigger = dict(SMALL, dim=48, n_layers=3)
    mgr2, *_ = make(tmp_path, model=bigger)
    with pytest.raises(UserError) as err:
        mgr2.load()
    text = str(err.value)
    assert "does not fit the configured model" in text
    assert "tok_embeddings.weight: checkpoint [64, 32] vs model [64, 48]" in text
    assert "layers.2.attention.wq.weight missing" in text


def test_damaged_checkpoint_names_step_and_older_one(tmp_path, caplog):
    mgr, parts, opt, state = make(tmp_path)
    for step in (1, 2):
        train_step(parts, opt, state, step)
        mgr.save(step)
    shard = tmp_path / "run/checkpoints/step_2/__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    # resume=auto skips it for the previous complete one, naming the file
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
        assert make(tmp_path, seed=1)[0].load() == 1
    assert "skipping damaged checkpoint" in caplog.text and "__0_0.distcp has 100 bytes" in caplog.text
    # asked for by name, it is an error that names the older one
    with pytest.raises(UserError) as err:
        make(tmp_path, seed=1, resume=str(shard.parent))[0].load()
    assert "step_2 is damaged" in str(err.value) and "__0_0.distcp has 100 bytes" in str(err.value)
    assert f"checkpoint.resume={tmp_path / 'run/checkpoints/step_1'}" in str(err.value)
    # same size, garbage content: the DCP metadata cannot be read
    meta = tmp_path / "run/checkpoints/step_1/.metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    step1 = str(tmp_path / "run/checkpoints/step_1")
    with pytest.raises(UserError, match=r"step_1 is damaged \(.metadata does not match its checksum"):
        make(tmp_path, seed=1, resume=step1)[0].load()
    with pytest.raises(UserError, match="step_1 has an unreadable .metadata"):
        make(tmp_path, seed=1, resume=step1, verify=False)[0].load()


def test_resume_none_refuses_existing_and_explicit_path_resumes(tmp_path):
    mgr, parts, opt, state = make(tmp_path)
    for step in (1, 2):
        train_step(parts, opt, state, step)
        mgr.save(step)
    with pytest.raises(UserError, match="resume='none' but .* already holds checkpoints"):
        make(tmp_path, resume="none")[0].load()
    step1 = tmp_path / "run/checkpoints/step_1"
    mgr2, parts2, opt2, state2 = make(tmp_path, resume=str(step1))
    assert mgr2.load() == 1
    train_step(parts2, opt2, state2, 9)
    mgr2.save(2)  # a new line of checkpoints replaces the abandoned step_2
    train_step(parts2, opt2, state2, 10)
    mgr2.save(3)
    assert files.read_metadata(tmp_path / "run/checkpoints/step_3")["resumed_from"] == str(step1.resolve())
    # the requeued job (same config) continues from its own progress, not from step_1 again
    assert make(tmp_path, resume=str(step1))[0].load() == 3


def test_init_from_loads_weights_with_fresh_optimizer(tmp_path):
    mgr, parts, opt, state = make(tmp_path / "a")
    train_step(parts, opt, state, 0)
    mgr.save(1)
    source = tmp_path / "a/run/checkpoints/step_1"
    mgr2, parts2, opt2, state2 = make(tmp_path / "b", seed=7, init_from=str(source))
    assert mgr2.load() is None
    assert state2.step == 0 and not opt2.state
    assert all(torch.equal(params(parts)[k], v) for k, v in params(parts2).items())
    # once the run has its own checkpoint, init_from is ignored
    train_step(parts2, opt2, state2, 1)
    mgr2.save(1)
    mgr3, *_ = make(tmp_path / "b", seed=7, init_from=str(source))
    assert mgr3.load() == 1


def test_pipeline_parts_and_whole_model_load_each_others_checkpoints(tmp_path):
    mgr, parts, opt, state = make(tmp_path / "pp", parts=2)
    assert isinstance(merged_view(parts), torch.nn.Module)
    for step in range(2):
        train_step(parts, opt, state, step)
    mgr.save(2)
    expected = [train_step(parts, opt, state, s) for s in (2, 3)]

    mgr1, whole, opt1, state1 = make(tmp_path / "pp", seed=3)
    assert mgr1.load() == 2
    assert [train_step(whole, opt1, state1, s) for s in (2, 3)] == pytest.approx(expected, abs=1e-6)
    mgr1.save(4)

    mgr2, parts2, opt2, state2 = make(tmp_path / "pp", seed=4, parts=2)
    assert mgr2.load() == 4
    assert params(parts2).keys() == params(parts).keys()
    assert all(torch.equal(params(whole)[k], v) for k, v in params(parts2).items())
    flat = {k for k in mgr2.state.optimizers[0].state_dict()["state"]}
    assert len(flat) == sum(1 for p in parts2 for _ in p.parameters())


def test_schedule_by_step_time_and_last():
    ticks = iter([0.0, 10.0, 30.0, 61.0, 62.0])
    sched = SaveSchedule(
        CheckpointConfig(interval=5, interval_minutes=1.0, save_initial=True),
        lambda flag: flag,
        lambda: next(ticks),
    )
    assert sched.due(0, False)  # save_initial (clock 10 s)
    assert not sched.due(3, False)  # 30 s
    assert sched.due(4, False)  # 61 s >= 1 minute
    sched.mark_saved()  # 62 s
    plain = SaveSchedule(CheckpointConfig(interval=5), lambda flag: flag)
    assert [s for s in range(1, 13) if plain.due(s, s == 12)] == [5, 10, 12]
    assert not SaveSchedule(CheckpointConfig(interval=0), lambda f: f).due(7, False)


def test_save_estimate_and_disabled(tmp_path):
    """checkpoint.enabled=false, owned by the front: no save by any path, no own checkpoint resumed."""
    mgr, parts, opt, state = make(tmp_path)
    train_step(parts, opt, state, 0)
    mgr.save(1)
    front, *_ = make_front(tmp_path, enabled=False)
    assert front.save_seconds_estimate() > 0
    assert front.restore() is None  # step_1 is there, but not resumed
    front.save_initial()
    assert not front.after_step(5, is_last=True)
    front.save_now(6, "signal")
    front.close(finished=True)
    assert [e.path.name for e in files.list_steps(tmp_path / "run/checkpoints")] == ["step_1"]


def test_checkpoint_of_an_older_format_gets_one_line(tmp_path):
    mgr, parts, opt, state = make(tmp_path)
    train_step(parts, opt, state, 0)
    mgr.save(1)
    step_dir = tmp_path / "run/checkpoints/step_1"
    meta = json.loads((step_dir / "metadata.json").read_text())
    (step_dir / "metadata.json").write_text(json.dumps(meta | {"format_version": 1}))
    checksums.write_complete(step_dir)
    with pytest.raises(UserError, match=r"step_1 has format 1 .* --checkpoint.init_from=.*step_1"):
        make(tmp_path, seed=1)[0].load()
    mgr2, parts2, *_ = make(tmp_path / "b", seed=1, init_from=str(step_dir))
    assert mgr2.load() is None and torch.equal(params(parts2)["norm.weight"], params(parts)["norm.weight"])
