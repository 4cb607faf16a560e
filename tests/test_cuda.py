"""The CUDA paths on a real GPU: tensors copied through pinned host buffers by checkpoint writes, loads and
snapshots, the step timer's CUDA events, the allocator's memory figures, NVML, the peak FLOP/s table, and
training, resuming and restoring a snapshot on the GPU.

Marked ``cuda``: collected everywhere, deselected (not skipped) on a machine without a CUDA GPU
(tests/conftest.py), so the suite is the same command on a laptop, in CI and on a GPU node. Elsewhere the
same code runs against stand-ins (tests/test_checkpoint_device.py, tests/test_step_syncs.py,
tests/test_monitor.py); here nothing is faked.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from relaytrain.checkpoint.host import DeviceCopy, HostStage
from relaytrain.checkpoint.snapshot.format import Staging, decode, layout_bytes
from relaytrain.checkpoint.storage import RawReader, RawWriter
from test_checkpoint_device import sample as host_sample

import faults
from conftest import TINY, child_env, kill_after_snapshots, losses_by_step, read_metrics, run_cli

pytestmark = pytest.mark.cuda


def sample(device: str) -> dict[str, torch.Tensor]:
    """test_checkpoint_device's tensors on `device`, "big" larger than the small stages below."""
    return {k: v.to(device) for k, v in host_sample(big=512).items()}


def test_cuda_tensors_are_saved_and_loaded_through_pinned_host_stages(tmp_path):
    values = sample("cuda")
    writer = RawWriter(tmp_path, stages=[HostStage(DeviceCopy(), capacity=64 << 10) for _ in range(2)])
    dcp.save(dict(values) | {"lr": 0.5}, storage_writer=writer, no_dist=True)
    targets = {k: torch.zeros_like(v) for k, v in values.items()} | {"lr": 0.0}
    reader = RawReader(tmp_path, expected=writer.checksums, copy=DeviceCopy())
    dcp.load(targets, storage_reader=reader, no_dist=True)
    for name, value in values.items():
        assert targets[name].device.type == "cuda", name
        assert torch.equal(targets[name], value), name
    assert targets["lr"] == 0.5


def test_a_snapshot_of_cuda_tensors_decodes_to_the_same_bytes():
    values = sample("cuda")
    staging = Staging(DeviceCopy())
    staged = staging.stage({"model": values, "step": 7}, {"step": 7})
    staged.hold_back()  # as the next optimizer step does before it changes the tensors
    for value in values.values():
        value.zero_()  # the staged copy was taken before: changing the source now must not reach it
    meta, back = decode(bytearray(b"".join(bytes(c) for c in staged.chunks())))
    assert meta == {"step": 7} and back["step"] == 7
    for name, value in sample("cuda").items():
        assert torch.equal(back["model"][name], value.cpu()), name


def test_snapshot_copies_run_on_a_side_stream_after_the_step_and_the_next_update_waits_for_them():
    """The copies follow the work queued before the snapshot (the optimizer step), the host only launches
    them, the next update queued behind them does not reach the snapshot, and one pinned buffer serves
    every snapshot."""
    device = torch.device("cuda", torch.cuda.current_device())  # as the tensors name it: cuda:0
    state = {"big": torch.randn(64 << 20, device=device), "small": torch.arange(7, device=device)}  # 256 MB
    a = torch.randn(4096, 4096, device=device)
    before = state["big"].cpu()
    copy = DeviceCopy()
    staging = Staging(copy)
    staging.reserve(layout_bytes(list(state.values())), pin=True)
    for _ in range(40):  # a long step on the device's stream, its update of `big` at the end
        a = a @ a / 64
    state["big"].add_(1.0)
    staged = staging.stage(state, {"step": 1})
    assert not staged.finished()  # launched behind the step's work, not waited for
    assert copy._side[device] != torch.cuda.current_stream(device)
    assert staged.hold_back() is True  # the next update waits for them on the device...
    state["big"].add_(1.0)  # ...so this does not reach the snapshot
    _, back = decode(bytearray(b"".join(bytes(c) for c in staged.chunks())))
    assert torch.equal(back["big"], before + 1.0) and torch.equal(back["small"], torch.arange(7))
    assert staged.data.is_pinned()
    staging.stage(state, {"step": 2}).wait()
    assert staging.allocations == 1  # reserved once, reused


def test_the_step_timer_charges_kernel_time_to_the_section_that_launched_it():
    from relaytrain.job.clock import StepClock
    from relaytrain.job.progress import Phase
    from relaytrain.monitor.timer import StepTimer

    a = torch.randn(4096, 4096, device="cuda")
    steps, timer = StepClock(device=torch.device("cuda")), StepTimer(torch.device("cuda"))
    steps.add_reader(timer)
    for _ in range(3):
        with steps.section(Phase.DATA):
            pass
        with steps.section(Phase.FORWARD_BACKWARD):
            for _ in range(20):
                a = a @ a / 64
    window = timer.window()
    assert window["forward_backward"] > 10 * window["data"] > 0
    assert window["step"] >= window["forward_backward"] > 0


def test_memory_figures_come_from_the_allocator_per_window():
    from relaytrain.monitor.memory import window_memory_stats

    device = torch.device("cuda")
    window_memory_stats(device)
    block = torch.empty(512 << 20, dtype=torch.uint8, device=device)  # 0.5 GiB
    first = window_memory_stats(device)
    del block  # still held when the first window ended: the second window's peak includes it
    torch.cuda.empty_cache()
    second = window_memory_stats(device)
    third = window_memory_stats(device)
    assert first["mem_peak_gib"] >= 0.5 and first["mem_alloc_retries"] == 0
    assert second["mem_peak_gib"] >= 0.5 > third["mem_peak_gib"], "the peak was not reset per window"


def test_nvml_reads_every_visible_gpu(tmp_path):
    from relaytrain.monitor.gpu_monitor import GpuCsv, open_nvml, sample_nvml

    nvml, gpus, reason = open_nvml()
    assert nvml is not None and len(gpus) >= torch.cuda.device_count(), reason
    rows = sample_nvml(nvml, gpus)
    assert float(rows[0]["mem_total_mib"]) > 1024 and rows[0]["gpu_uuid"].startswith("GPU-")
    out = GpuCsv(tmp_path / "gpu.csv")
    out.write(rows)
    out.close()
    assert len((tmp_path / "gpu.csv").read_text().splitlines()) == 1 + len(rows)


def test_the_peak_flops_table_knows_this_gpu():
    from relaytrain.monitor.mfu import peak_flops_per_device

    peak = peak_flops_per_device(torch.device("cuda", 0))
    assert peak.flops > 0, f"{torch.cuda.get_device_name(0)} is not in the peak table: MFU would read 0"


# The tests' tiny model, a little wider and longer so that a step is not all kernel launches.
TINY_CUDA = [*TINY, "--model.dim=128", "--train.seq_len=64", "--run.device=cuda"]


def test_a_run_on_the_gpu_trains_and_reports_mfu_and_memory(tmp_path):
    args = ["train", *TINY_CUDA, f"--run.dir={tmp_path / 'runs'}", "--run.name=r", "--train.max_steps=30"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "runs/r")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["mfu"] > 0 and r["mem_peak_gib"] > 0 for r in records[1:])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_run_on_the_gpu_continues_the_loss_curve(tmp_path, mode):
    """fp32 parameters: a resume reads back the exact state; the losses after it equal the uninterrupted
    run's to within the GPU kernels' run-to-run differences (atomics in the embedding's backward)."""
    base = ["train", *TINY_CUDA, f"--run.dir={tmp_path / 'runs'}", "--train.max_steps=12"]
    base += ["--parallel.param_dtype=float32", "--checkpoint.interval=4", f"--checkpoint.mode={mode}"]
    ref = run_cli([*base, "--run.name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for extra in (["--train.stop_at_step=6"], []):
        proc = run_cli([*base, "--run.name=cut", *extra], tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming from" in proc.stdout + proc.stderr
    got, want = losses_by_step(tmp_path / "runs/cut"), losses_by_step(tmp_path / "runs/ref")
    assert sorted(got) == sorted(want)
    for step in sorted(want):
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), (step, got[step], want[step])


def test_a_killed_run_on_the_gpu_restores_its_snapshot_from_node_memory(tmp_path):
    shm = tmp_path / "shm"
    args = ["train", *TINY_CUDA, f"--run.dir={tmp_path / 'runs'}", "--train.max_steps=10"]
    args += ["--parallel.param_dtype=float32", "--checkpoint.interval=0", "--checkpoint.snapshot_every=1"]
    args += [f"--checkpoint.snapshot_dir={shm}"]
    ref = run_cli([*args, "--run.name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd = [sys.executable, "-m", "relaytrain.cli", *args, "--run.name=cut"]
    env = child_env(**faults.env(step_delay_s=0.3))
    with open(tmp_path / "cut.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    kill_after_snapshots(proc, shm, 2)
    again = run_cli([*args, "--run.name=cut"], tmp_path)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "in node memory" in out and "starting fresh" not in out, out[-3000:]
    got, want = losses_by_step(tmp_path / "runs/cut"), losses_by_step(tmp_path / "runs/ref")
    for step in sorted(want):
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), (step, got[step], want[step])
    starts = [json.loads(x) for x in (tmp_path / "runs/cut/metrics.jsonl").read_text().splitlines()]
    assert any(r.get("restored_from") == "node memory" for r in starts)
