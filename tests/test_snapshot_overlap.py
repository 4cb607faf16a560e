"""Snapshots off the step's critical path, in the order a GPU runs them, on CPU.

A snapshot's device-to-host copies are only launched by the step that takes it (on a GPU: on a side
stream, after the optimizer step); they run beside the next step's forward and backward. `SideStream`
replaces checkpoint.host.DeviceCopy and lets the test decide when they finish: a copy reads its source
when it lands (like a DMA that has not run yet), which is when the test completes it, when the optimizer
step holds back for it, or when the writer thread waits for it, and the writer's wait blocks until the
test opens `gate`. Tensors on torch's ``meta`` device stand for device tensors.

Proved here: the optimizer step waits for a copy still running (and only then), the host buffer is not
reused before its snapshot was copied and written, and one buffer is allocated per run, in the background
at start-up, sized from the state (a never-stepped AdamW's moments included).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.host import DeviceCopy, InFlight
from relaytrain.checkpoint.snapshot import store
from relaytrain.checkpoint.snapshot.format import decode
from relaytrain.checkpoint.snapshot.tier import SnapshotTier
from relaytrain.checkpoint.training_state import TrainingState
from relaytrain.config.schema import CheckpointConfig, ModelConfig
from relaytrain.job.rundir import RunDir
from relaytrain.model import Transformer


def key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class SideStream(DeviceCopy):
    def __init__(self):
        super().__init__(pin=False)
        self.values: dict[int, torch.Tensor] = {}  # meta tensor's storage -> its contents on the "device"
        self.log: list[str] = []
        self.allocated: list[int] = []
        self.written: dict[int, dict] = {}  # step -> the state tree its snapshot file holds
        self.gate = threading.Event()  # closed: the writer thread's wait for the copies blocks
        self.gate.set()
        self._lock = threading.Lock()

    def put(self, value: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty_like(value, device="meta")
        self.values[key(tensor)] = value.clone()
        return tensor

    def empty(self, nbytes: int, pin: bool = True) -> torch.Tensor:
        self.allocated.append(nbytes)
        self.log.append("alloc")
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, pairs):
        assert all(src.device.type == "meta" and dst.device.type == "cpu" for dst, src in pairs)
        for dst, _ in pairs:
            dst.fill_(0x55 if dst.dtype.is_floating_point else 7)  # not there yet
        copies = [lambda dst=dst, src=src: dst.copy_(self.values[key(src)]) for dst, src in pairs]
        self.log.append("launch")
        return InFlight([torch.device("meta")], events=[{"copies": copies, "landed": False}])

    def _land(self, flight: InFlight, by: str) -> None:
        with self._lock:
            state = flight.events[0]
            if not state["landed"]:
                for copy in state["copies"]:
                    copy()
                state["landed"] = True
                self.log.append(f"landed by {by}")

    def finished(self, flight):
        return flight.events[0]["landed"]

    def wait(self, flight):
        assert self.gate.wait(30), "the test never opened the gate"
        self._land(flight, "writer")

    def hold_back(self, flight):
        self._land(flight, "optimizer step")

    def complete(self, flight) -> None:
        """The copies finish on their own, during the next step's forward and backward."""
        self._land(flight, "itself")


class MetaState:
    """A TrainingState stand-in whose model and optimizer tensors are on the "device"."""

    def __init__(self, device: SideStream):
        self.device = device
        self.optimizers: list = []
        g = torch.Generator().manual_seed(0)
        self.values = {"w": torch.randn(40, 30, generator=g), "exp_avg": torch.randn(40, 30, generator=g)}
        self.tensors = {name: device.put(value) for name, value in self.values.items()}
        self.step = 0

    def has_optimizer_state(self) -> bool:
        return True

    def state_dict(self, *, optimizer: bool):
        tree = {"model": {"w": self.tensors["w"]}, "states": {"train": {"step": self.step}}}
        if optimizer:
            tree["optim"] = {"state.w.exp_avg": self.tensors["exp_avg"]}
        return tree

    def on_device(self, name: str) -> torch.Tensor:
        return self.device.values[key(self.tensors[name])]

    def optimizer_step(self) -> None:
        """What the step changes in place on the device."""
        self.step += 1
        for name in self.tensors:
            self.on_device(name).add_(1.0)


def build(tmp_path, state, copy) -> SnapshotTier:
    cfg = CheckpointConfig(snapshot_every=1, snapshot_dir=str(tmp_path / "shm"))
    coll = Collectives(0, 1, replicas=False)
    tier = SnapshotTier(cfg, RunDir(tmp_path / "run"), "h", state, coll, copy=copy)
    tier.prepare()
    return tier


def snapshot_of(tier: SnapshotTier, step: int) -> tuple[dict, dict]:
    data = store.read_file(store.step_dir(tier.node_dir, step), 0)
    return decode(data)


@pytest.fixture
def side(tmp_path, monkeypatch):
    device = SideStream()
    state = MetaState(device)
    write = store.write_snapshot

    def logged(step_path, rank, chunks, meta):
        chunks = [bytes(chunk) for chunk in chunks]  # what the writer read from the buffer
        entry = write(step_path, rank, chunks, meta)
        device.written[meta["step"]] = decode(bytearray(b"".join(chunks)))[1]
        device.log.append(f"wrote step {meta['step']}")
        return entry

    monkeypatch.setattr(store, "write_snapshot", logged)
    tier = build(tmp_path, state, device)
    yield device, state, tier
    device.gate.set()
    tier.close(finished=False)


def test_the_step_only_launches_the_copies_and_the_optimizer_step_waits_for_one_still_running(side):
    device, state, tier = side
    state.optimizer_step()
    want = {name: state.on_device(name).clone() for name in state.tensors}
    device.gate.clear()  # the copies have not run when the step after the snapshot reaches its update
    tier.take(1)
    assert device.log[-1] == "launch"  # returned with the copies in flight
    assert tier.before_update() is True and tier.held_back == 1
    assert device.log[-1] == "landed by optimizer step"
    state.optimizer_step()  # changes the state only now
    device.gate.set()
    tier.wait()
    _, tree = snapshot_of(tier, 1)
    assert torch.equal(tree["model"]["w"], want["w"])
    assert torch.equal(tree["optim"]["state.w.exp_avg"], want["exp_avg"])
    assert tree["states"]["train"]["step"] == 1


def test_a_copy_that_finished_beside_forward_and_backward_holds_nothing_back(side):
    device, state, tier = side
    device.gate.clear()  # the writer does not wait for them first
    tier.take(1)
    device.complete(tier._copying.copies)
    assert tier.before_update() is False and tier.held_back == 0
    assert "landed by optimizer step" not in device.log
    assert tier.before_update() is False  # once per snapshot: the next step has nothing to wait for
    device.gate.set()
    tier.wait()
    assert device.log[-1] == "wrote step 1"


def test_the_host_buffer_is_not_reused_before_its_snapshot_was_copied_and_written(side):
    device, state, tier = side
    state.optimizer_step()
    want_1 = state.on_device("w").clone()
    device.gate.clear()  # the writer of step 1 cannot read the buffer yet
    tier.take(1)
    tier.before_update()
    state.optimizer_step()
    want_2 = state.on_device("w").clone()

    def next_snapshot():
        tier.take(2)  # waits for step 1's write before its copies go into the same buffer
        tier.before_update()  # and its copies land

    second = threading.Thread(target=next_snapshot)
    second.start()
    time.sleep(0.5)
    assert device.log.count("launch") == 1, device.log  # step 2's copies wait for step 1's write
    device.gate.set()
    second.join(30)
    tier.wait()
    assert device.log.index("wrote step 1") < len(device.log) - device.log[::-1].index("launch") - 1
    assert torch.equal(device.written[1]["model"]["w"], want_1)
    assert torch.equal(device.written[2]["model"]["w"], want_2)


def test_one_host_buffer_per_run_sized_from_the_state_at_start_up(side):
    device, state, tier = side
    waited = time.monotonic()
    while not device.allocated and time.monotonic() - waited < 10:
        time.sleep(0.01)
    assert len(device.allocated) == 1  # at start-up, before any snapshot: in the background
    for step in range(1, 6):
        state.optimizer_step()
        tier.take(step)
        tier.before_update()
    tier.wait()
    assert len(device.allocated) == 1, device.allocated  # every snapshot reused it
    assert torch.equal(snapshot_of(tier, 5)[1]["model"]["w"], state.on_device("w"))


class Counting(DeviceCopy):
    def __init__(self):
        super().__init__(pin=False)
        self.allocated: list[int] = []

    def empty(self, nbytes: int, pin: bool = True) -> torch.Tensor:
        self.allocated.append(nbytes)
        return super().empty(nbytes, pin)


def test_a_fresh_run_allocates_once_for_the_state_its_first_adamw_step_creates(tmp_path):
    """At start-up a never-stepped AdamW holds no state: the buffer is sized with the moments it will have."""
    # moments of 3 MB: beyond the headroom the estimate adds
    shape = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)
    model = Transformer(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    copy = Counting()
    tier = build(tmp_path, TrainingState([model], [opt]), copy)
    try:
        for step in range(1, 4):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * step)
            tier.before_update()
            opt.step()
            tier.take(step)
        tier.wait()
        assert len(copy.allocated) == 1, copy.allocated
        _, tree = snapshot_of(tier, 3)
        for name, value in model.state_dict().items():
            assert torch.equal(tree["model"][name], value), name
    finally:
        tier.close(finished=False)


def test_the_tier_says_when_its_background_work_ended_which_caps_the_steps_charge(side):
    """The pacing charges a step beside a snapshot's work at most the time that work ran during it
    (`pacing.py`): the tier gives that end time, none while the work still runs."""
    device, state, tier = side
    device.gate.clear()  # the writer waits for the copies, so the work runs until the gate opens
    tier.take(1)
    assert tier.background_running and tier.background_ended_at is None
    released = time.perf_counter()
    device.gate.set()
    tier.wait()
    assert not tier.background_running
    assert released <= tier.background_ended_at <= time.perf_counter()
