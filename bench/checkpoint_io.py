"""Checkpoint I/O: save/load throughput (sync and async) against the disk's own sequential speed.

    python bench/checkpoint_io.py [--dir DIR] [--dim 768 --layers 12 --vocab 16384] [--repeats 2]

Builds a ~100M-parameter model with AdamW state (one optimizer step), then measures in one process:
- the disk: sequential write of a file as large as the checkpoint with fsync, and its read with the page
  cache dropped (posix_fadvise DONTNEED, which needs no root), the same way checkpoint files are read;
- CheckpointManager sync save (until COMPLETE), async save (time training is blocked, and time until
  committed), and load (model + optimizer + train state, page cache dropped first; with and without
  the checksum comparison, `checkpoint.verify`). An async save is
  followed by one training step, as in training: a save of host-memory state writes from the live
  tensors and the next optimizer step waits for that write, so "blocked" is the save call plus that
  wait; "until committed" is the write plus the commit (not the training step around them). The same
  async save with the trainer idle (save, then wait) separates the async path's own cost from the
  contention with the step on the machine's cores;
- the CPU seconds (all threads, `time.process_time`) of a sync save, a training step, the async save
  window with its training step, and a load, and how busy the cores were during the async window: a
  write that competes with a step on saturated cores cannot finish sooner than their CPU seconds allow;
- the peak resident memory of the process during each, above what it held before (sampled every 5 ms).
Prints a Markdown table (best of --repeats) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from relaytrain.checkpoint import Persistence, RunRecord, TrainingState
from relaytrain.config import Config, config_hash, config_to_toml
from relaytrain.config.schema import ModelConfig
from relaytrain.job import RunDir
from relaytrain.model import Transformer, count_parameters


class BenchState:
    def __init__(self):
        self.step = 1

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, d):
        self.step = d["step"]


def drop_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_speed(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s for one sequential file of `nbytes`: write+fsync, then read uncached."""
    path = directory / "disk_probe.bin"
    block = os.urandom(1 << 20) * 16  # 16 MiB, incompressible
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        os.fsync(f.fileno())
    write = written / (time.perf_counter() - t0)
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    read = written / (time.perf_counter() - t0)
    path.unlink()
    return write, read


class PeakRss:
    """Peak resident set size while the block runs, above the size at its start (bytes)."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fresh_read_speed(path: Path) -> float:
    """Bytes/s reading `path` uncached into freshly allocated memory with readinto (64 MiB at a time): what
    a resume needs at least, since a fresh process must fault in the pages it loads into (the disk probe
    reads into one 16 MiB buffer that stays in the CPU caches)."""
    drop_cache(path)
    t0 = time.perf_counter()
    target = memoryview(torch.empty(path.stat().st_size, dtype=torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        for start in range(0, len(target), 64 << 20):
            f.readinto(target[start : start + (64 << 20)])
    return len(target) / (time.perf_counter() - t0)


def memory_write_speed(directory: Path, source: torch.Tensor) -> float:
    """Bytes/s writing `source` (a tensor already in memory, as large as the checkpoint) to one file in
    64 MiB writes, then fsync: what any writer of the checkpoint's bytes needs on this machine, at least
    (the disk probe writes one 16 MiB buffer that stays in the CPU caches)."""
    path = directory / "memory_probe.bin"
    view = memoryview(source.view(torch.uint8).numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for start in range(0, len(view), 64 << 20):
            f.write(view[start : start + (64 << 20)])
        f.flush()
        os.fsync(f.fileno())
    speed = len(view) / (time.perf_counter() - t0)
    return speed


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(cfg: Config, run_dir: Path, mode: str, verify: bool = True):
    cfg.checkpoint.mode = mode
    cfg.checkpoint.verify = verify
    cfg.checkpoint.keep_last = 1
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    front = Persistence(
        cfg.checkpoint,
        RunDir(run_dir),
        RunRecord("bench", config_to_toml(cfg), config_hash(cfg), cfg.model, cfg.data.tokenizer),
        TrainingState([model], [opt], {"train_state": BenchState()}),
        rank=0,
        world_size=1,
        parallel_dims={"world_size": 1},
    )
    return model, opt, front.checkpoints  # the DCP tier, measured on its own


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir under ./runs)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    base = Path(args.dir) if args.dir else Path("runs")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=base))
    cfg = Config()
    cfg.model = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=12, n_kv_heads=4, vocab_size=args.vocab
    )
    model, opt, mgr = build(cfg, work / "run", "sync")
    params = count_parameters(cfg.model)
    tokens = torch.randint(0, args.vocab, (1, 64))

    def train_step(model, opt) -> float:
        t0 = time.perf_counter()
        model(tokens).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    train_step(model, opt)
    cpu0 = time.process_time()
    step_s = min(train_step(model, opt) for _ in range(2))
    cpu_s: dict[str, float] = {"train_step": (time.process_time() - cpu0) / 2}

    results: dict[str, list[float]] = {
        k: []
        for k in ("sync_save", "async_block", "async_total", "async_idle_total", "load", "load_unverified")
    }
    busy: list[float] = []  # the cores' busy fraction during an async save window with a step in it
    extra_mem: dict[str, int] = {"sync_save": 0, "async_save": 0, "load": 0}
    # The disk is shared and its speed drifts: it is probed next to every save and load it is compared with.
    probe_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    disk_writes: list[float] = []
    disk_reads: list[float] = []

    def probe_disk() -> None:
        write, read = disk_speed(work, probe_bytes)
        disk_writes.append(write)
        disk_reads.append(read)

    step = 1
    for _ in range(args.repeats):
        probe_disk()
        t0, cpu0 = time.perf_counter(), time.process_time()
        with PeakRss() as mem:
            mgr.save(step)
        results["sync_save"].append(time.perf_counter() - t0)
        cpu_s["sync_save"] = min(cpu_s.get("sync_save", 1e9), time.process_time() - cpu0)
        extra_mem["sync_save"] = max(extra_mem["sync_save"], mem.extra)
        step += 1
    ckpt_bytes = dir_bytes(work / "run/checkpoints" / f"step_{step - 1}")
    mgr.close()

    async_model, async_opt, amgr = build(cfg, work / "run", "async")
    async_model.load_state_dict(model.state_dict())
    async_opt.load_state_dict(opt.state_dict())
    for _ in range(args.repeats):
        t0, cpu0 = time.perf_counter(), time.process_time()
        with PeakRss() as mem:
            amgr.save(step)
            train_step(async_model, async_opt)
            amgr.wait()
        window_cpu, window_s = time.process_time() - cpu0, time.perf_counter() - t0
        busy.append(window_cpu / (window_s * (os.cpu_count() or 1)))
        cpu_s["async_window"] = min(cpu_s.get("async_window", 1e9), window_cpu)
        results["async_block"].append(amgr.last_save["blocking_s"])
        results["async_total"].append(amgr.last_save["written_s"] + amgr.last_save["commit_s"])
        extra_mem["async_save"] = max(extra_mem["async_save"], mem.extra)
        step += 1
    for _ in range(args.repeats):
        amgr.save(step)
        amgr.wait()
        results["async_idle_total"].append(amgr.last_save["written_s"] + amgr.last_save["commit_s"])
        step += 1
    amgr.close()

    for _ in range(args.repeats):
        probe_disk()
        drop_cache(work / "run/checkpoints")
        _, _, lmgr = build(cfg, work / "run", "sync")
        t0, cpu0 = time.perf_counter(), time.process_time()
        with PeakRss() as mem:
            assert lmgr.load() == step - 1
        results["load"].append(time.perf_counter() - t0)
        cpu_s["load"] = min(cpu_s.get("load", 1e9), time.process_time() - cpu0)
        extra_mem["load"] = max(extra_mem["load"], mem.extra)
        lmgr.close()
        drop_cache(work / "run/checkpoints")
        _, _, umgr = build(cfg, work / "run", "sync", verify=False)
        t0 = time.perf_counter()
        assert umgr.load() == step - 1
        results["load_unverified"].append(time.perf_counter() - t0)
        umgr.close()

    disk_w, disk_r = max(disk_writes), max(disk_reads)
    source = torch.arange(ckpt_bytes // 8, dtype=torch.int64)
    mem_w = max(memory_write_speed(work, source) for _ in range(args.repeats))
    del source
    mem_r = max(fresh_read_speed(work / "memory_probe.bin") for _ in range(args.repeats))
    shutil.rmtree(work)
    best = {k: min(v) for k, v in results.items()}
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    mb = ckpt_bytes / 1e6
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()}")
    print(f"model: {params / 1e6:.1f} M params; checkpoint (model + AdamW + train state) {mb:.0f} MB")
    # The save path is CPU-bound (serialization, copies): other processes on the machine slow it directly.
    print(
        f"1-min load average: {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
        f"best of {args.repeats}; one training step (1 x 64 tokens) {step_s:.2f} s\n"
    )
    print("| measurement | time (s) | MB/s | vs disk |")
    print("| --- | --- | --- | --- |")
    print(f"| disk sequential write + fsync | {ckpt_bytes / disk_w:.2f} | {disk_w / 1e6:.0f} | 1.00 |")
    print(f"| disk sequential read, uncached | {ckpt_bytes / disk_r:.2f} | {disk_r / 1e6:.0f} | 1.00 |")
    print(
        f"| floor: write of checkpoint-sized memory + fsync | {ckpt_bytes / mem_w:.2f} | "
        f"{mem_w / 1e6:.0f} | {mem_w / disk_w:.2f} |"
    )
    print(
        f"| floor: uncached read into fresh memory | {ckpt_bytes / mem_r:.2f} | {mem_r / 1e6:.0f} | "
        f"{mem_r / disk_r:.2f} |"
    )
    print(
        f"| sync save (to COMPLETE) | {best['sync_save']:.2f} | {mb / best['sync_save']:.0f} | "
        f"{ckpt_bytes / best['sync_save'] / disk_w:.2f} |"
    )
    print(f"| async save, training blocked | {best['async_block']:.2f} | | |")
    print(
        f"| async save, until committed | {best['async_total']:.2f} | {mb / best['async_total']:.0f} | "
        f"{ckpt_bytes / best['async_total'] / disk_w:.2f} |"
    )
    print(
        f"| async save, until committed, trainer idle | {best['async_idle_total']:.2f} | "
        f"{mb / best['async_idle_total']:.0f} | {ckpt_bytes / best['async_idle_total'] / disk_w:.2f} |"
    )
    print(
        f"| load (resume), uncached | {best['load']:.2f} | {mb / best['load']:.0f} | "
        f"{ckpt_bytes / best['load'] / disk_r:.2f} |"
    )
    print(
        f"| load (resume), uncached, checkpoint.verify = false | {best['load_unverified']:.2f} | "
        f"{mb / best['load_unverified']:.0f} | {ckpt_bytes / best['load_unverified'] / disk_r:.2f} |"
    )
    cores = os.cpu_count() or 1
    print(
        f"\nCPU seconds (all threads): sync save {cpu_s['sync_save']:.2f}, training step "
        f"{cpu_s['train_step']:.2f}, async save window with its step {cpu_s['async_window']:.2f} "
        f"(cores busy {100 * max(busy):.0f}% of {cores} × the window), load {cpu_s['load']:.2f}. "
        f"A write beside the step on {cores} saturated cores needs at least (sync save + step CPU) / "
        f"{cores} = {(cpu_s['sync_save'] + cpu_s['train_step']) / cores:.2f} s."
    )
    print(
        "\npeak host memory above the process's before each (state = model + AdamW + train state, "
        f"{mb:.0f} MB): "
        + ", ".join(
            f"{k.replace('_', ' ')} {v / 1e6:.0f} MB ({v / ckpt_bytes:.2f} × state)"
            for k, v in extra_mem.items()
        )
        + "\n"
    )
    print(
        json.dumps(
            {
                "params": params,
                "checkpoint_bytes": ckpt_bytes,
                "disk_write_Bps": disk_w,
                "disk_read_Bps": disk_r,
                **{k: v for k, v in best.items()},
                "peak_extra_bytes": extra_mem,
                "train_step": step_s,
                "memory_write_Bps": mem_w,
                "fresh_read_Bps": mem_r,
                "cpu_s": cpu_s,
                "async_window_busy": max(busy),
                "cores": os.cpu_count() or 1,
                "load_average": [load_before, os.getloadavg()[0]],
            }
        )
    )


if __name__ == "__main__":
    main()
