"""Checkpoint files and snapshots of tensors that are not in host memory (on a GPU in a real run).

No accelerator here: tensors on torch's ``meta`` device stand for device tensors (``.numpy()`` refuses
them exactly as it refuses CUDA tensors), and `FakeDevice` replaces checkpoint.host.DeviceCopy, holding
their values and behaving like non-blocking copies: a copy lands only at the next synchronisation and
reads its source then, so code that reads a host buffer before synchronising, or reuses it while a copy
from it is in flight, gets wrong bytes.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner

from relaytrain.checkpoint.host import DeviceCopy, HostStage
from relaytrain.checkpoint.snapshot.format import Staging, decode
from relaytrain.checkpoint.storage import RawReader, RawWriter


def key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class FakeDevice(DeviceCopy):
    def __init__(self):
        super().__init__(pin=False)
        self.values: dict[int, torch.Tensor] = {}  # meta tensor's storage -> its contents
        self.pending: list = []
        self.log: list[str] = []

    def put(self, value: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty_like(value, device="meta")
        self.values[key(tensor)] = value.clone()
        return tensor

    def to_host(self, dst, src):
        assert src.device.type == "meta" and dst.device.type == "cpu"
        dst.fill_(0x55 if dst.dtype.is_floating_point else 7)  # not there yet
        self.pending.append(lambda: dst.copy_(self.values[key(src)]))
        self.log.append("to_host")

    def to_device(self, dst, src):
        assert src.device.type == "cpu" and dst.device.type == "meta"
        self.pending.append(lambda: self.values.__setitem__(key(dst), src.clone()))
        self.log.append("to_device")

    def synchronize(self, devices):
        assert {d.type for d in devices} == {"meta"}
        for land in self.pending:
            land()
        self.pending.clear()
        self.log.append("sync")


def sample(big: int = 64) -> dict[str, torch.Tensor]:
    """Tensors of every kind a state holds; "big" (big x big) larger than the buffers of the test using it
    (tests/test_cuda.py moves them to the GPU)."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 70, generator=g),
        "half": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "big": torch.randn(big, big, generator=g),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }


def test_device_tensors_are_saved_through_the_host_buffer_with_one_sync_per_fill(tmp_path):
    device, values = FakeDevice(), sample()
    state = {k: device.put(v) for k, v in values.items()} | {"host": torch.arange(5.0), "lr": 0.5}
    writer = RawWriter(tmp_path, stages=[HostStage(device), HostStage(device)])
    dcp.save(state, storage_writer=writer, no_dist=True)
    # one synchronisation per writer thread, after all of its copies (the buffer holds them all)
    assert device.log.count("sync") == 2 and device.log[-1] == "sync"
    assert device.log.count("to_host") == len(values) - 1  # the empty tensor needs no copy
    loaded = {k: torch.zeros_like(v) for k, v in values.items()} | {"host": torch.zeros(5), "lr": 0.0}
    dcp.load(loaded, storage_reader=RawReader(tmp_path, expected=writer.checksums))
    for name, value in values.items():
        assert torch.equal(loaded[name], value), name
    assert torch.equal(loaded["host"], torch.arange(5.0)) and loaded["lr"] == 0.5


def test_a_small_buffer_is_filled_synchronised_written_and_reused(tmp_path):
    device, g = FakeDevice(), torch.Generator().manual_seed(1)
    values = {f"t{i}": torch.randn(600, generator=g) for i in range(8)} | {"big": torch.randn(3000)}
    state = {k: device.put(v) for k, v in values.items()}
    stages = [HostStage(device, capacity=4096) for _ in range(2)]  # 1.5 tensors of 2400 bytes a fill
    dcp.save(state, storage_writer=RawWriter(tmp_path, stages=stages), no_dist=True)
    assert device.log.count("sync") >= 6  # several fills per thread; the big tensor grows the buffer
    loaded = {k: torch.zeros_like(v) for k, v in values.items()}
    dcp.load(loaded, storage_reader=RawReader(tmp_path))
    for name, value in values.items():
        assert torch.equal(loaded[name], value), name


def test_device_targets_are_read_into_host_memory_and_copied_over(tmp_path, monkeypatch):
    # DCP's load planner swaps meta targets for empty tensors on the default device; keep them
    monkeypatch.setattr(default_planner, "_init_state_dict", lambda state_dict: None)
    values = sample()
    dcp.save(dict(values), storage_writer=RawWriter(tmp_path), no_dist=True)
    device = FakeDevice()
    targets = {k: device.put(torch.zeros_like(v)) for k, v in values.items()}
    reader = RawReader(tmp_path, expected={}, copy=device)
    reader._stages.put(HostStage(device, capacity=4096))  # small: its space is reused within the load
    dcp.load(targets, storage_reader=reader, no_dist=True)
    assert device.log[-1] == "sync" and not device.pending
    for name, value in values.items():
        assert torch.equal(device.values[key(targets[name])], value), name


def test_snapshot_staging_copies_without_waiting_and_synchronises_once_before_it_is_read():
    device, values = FakeDevice(), sample()
    tree = {"model": {k: device.put(v) for k, v in values.items()}, "step": 3, "cpu": torch.arange(4)}
    staging = Staging(device)
    staged = staging.stage(tree, {"step": 3})
    assert device.log == ["to_host"] * (len(values) - 1)  # launched: the step does not wait for them
    chunks = staged.chunks()  # the writer's read waits for them, once
    assert device.log == ["to_host"] * (len(values) - 1) + ["sync"]
    meta, back = decode(bytearray(b"".join(bytes(c) for c in chunks)))
    assert meta == {"step": 3} and back["step"] == 3 and torch.equal(back["cpu"], torch.arange(4))
    for name, value in values.items():
        assert torch.equal(back["model"][name], value), name
