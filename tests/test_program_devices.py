"""relaytrain.program's collectives run where the program's default group takes tensors: the host with
a CPU backend, else this process's accelerator, and its barrier names that device (NCCL otherwise
guesses the device from the rank). The accelerator branch runs here with the group's device type and
the current device replaced, since this machine has no GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from relaytrain import program


def test_a_gloo_group_uses_the_host_and_its_barrier_passes(tmp_path):
    assert program._collective_device() == torch.device("cpu")  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert program._collective_device() == torch.device("cpu")
        program._barrier()
    finally:
        dist.destroy_process_group()


def test_an_accelerator_group_uses_this_process_device_and_names_it_in_the_barrier(tmp_path, monkeypatch):
    barriers = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # what NCCL ("cuda"), "cuda:nccl" or XCCL-like groups report: no CPU backend
        monkeypatch.setattr(dist.distributed_c10d, "_get_object_coll_device", lambda group=None: "cuda")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(dist, "barrier", lambda **kwargs: barriers.append(kwargs))
        assert program._collective_device() == torch.device("cuda", 3)
        program._barrier()
        assert barriers == [{"device_ids": [3]}]
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
