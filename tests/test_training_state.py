"""One training state for every persistence path: a component registered once, in one place, is saved by a
DCP checkpoint, taken by a snapshot, and restored by both (one process on a gloo group, as the trainer's
front runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relaytrain.checkpoint import Persistence, RunRecord, TrainingState
from relaytrain.checkpoint.files import train_state_file
from relaytrain.checkpoint.snapshot import store
from relaytrain.checkpoint.snapshot.format import decode
from relaytrain.config import Config, config_hash, config_to_toml
from relaytrain.config.schema import ModelConfig
from relaytrain.job import RunDir
from relaytrain.model import Transformer

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


class Counter:
    """A new piece of training state (a stateful scheduler, a data loader's extra state, ...)."""

    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = int(state["value"])


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build(tmp_path: Path, seed: int):
    cfg = Config()
    cfg.model = ModelConfig(**SMALL)
    cfg.checkpoint.interval = 2
    cfg.checkpoint.snapshot_every = 1
    cfg.checkpoint.snapshot_dir = str(tmp_path / "shm")
    torch.manual_seed(seed)
    model = Transformer(cfg.model)
    model.init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = Counter()
    training = TrainingState([model], [opt])
    training.register("counter", counter)  # the one change that adds the component to every path
    record = RunRecord("run", config_to_toml(cfg), config_hash(cfg), cfg.model, "byte")
    front = Persistence(cfg.checkpoint, RunDir(tmp_path / "run"), record, training, rank=0, world_size=1,
                        parallel_dims={})  # fmt: skip
    return front, model, opt, counter


def train_step(model, opt, counter, step: int) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01 * step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    counter.value = 11 * step


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_component_registered_once_is_saved_taken_and_restored_by_both(tmp_path, gloo_world):
    front, model, opt, counter = build(tmp_path, seed=0)
    assert front.collectives.replica_group is not None  # snapshots on: the one set has its third group
    assert front.restore() is None
    seen = {}
    for step in (1, 2, 3):  # interval 2: a checkpoint at step 2; a snapshot after every step
        train_step(model, opt, counter, step)
        front.after_step(step, is_last=False)
        seen[step] = weights(model)
    front.snapshots.wait()
    front.close(finished=False)  # a crash's restart: the snapshots stay in node memory

    # saved by DCP: this rank's train state file holds the component at step 2
    saved = torch.load(train_state_file(tmp_path / "run/checkpoints/step_2", 0), weights_only=True)
    assert saved["states"]["counter"] == {"value": 22}
    # taken by a snapshot: this rank's file of step 3 holds it
    node = next((tmp_path / "shm").glob("relaytrain-local-*/*"))
    _, tree = decode(store.read_file(store.step_dir(node, 3), 0))
    assert tree["states"]["counter"] == {"value": 33}

    # restored by the snapshot tier (newer than the checkpoint)
    front, model, opt, counter = build(tmp_path, seed=1)
    assert front.restore() == 3
    assert counter.value == 33 and same(weights(model), seen[3])
    front.close(finished=True)  # a finished run deletes its snapshots

    # restored by DCP (no snapshot left)
    front, model, opt, counter = build(tmp_path, seed=2)
    assert front.restore() == 2
    assert counter.value == 22 and same(weights(model), seen[2])
    front.close(finished=True)
