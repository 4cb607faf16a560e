"""In-memory snapshots: what a snapshot blocks of a training step, how fast a large state is copied,
written to /dev/shm and read back, replicated to a peer node and restored from each tier.

    python bench/snapshot.py [--steps 12] [--state-gb 1.2] [--wide-steps 6]
                              [--parts debug,wide,state,nodes,gpu] [--no-lock]

1. The debug config (configs/debug.toml), one process, `checkpoint.snapshot_every=1`, against the same
   run without snapshots: the median step time of each and the median blocking time per snapshot
   (`snapshot_blocking_s` in metrics.jsonl), steps 3.. (the first ones warm up); then the same for the
   debug config widened to about `--state-gb` GB of state in one process (the share of a real step that a
   large state's snapshot blocks).
2. A state of `--state-gb` GB (fp32 tensors of 4 M elements, about a 100 M-parameter model with AdamW): the
   blocking copy into the reused host buffer (second and later snapshots), the background write to
   /dev/shm with its checksum, and reading and decoding it back (a restore from local memory).
3. Two nodes of the local Slurm cluster (`relaytrain cluster up`; each node has its own /dev/shm), one
   rank each, the debug config with the model widened to about `--state-gb` GB of state per rank
   (bench/snapshot_nodes.py, launched with `relaytrain launch --command` under the cluster's lock):
   the exchange of the two ranks' snapshots over the gloo group (replication throughput), and the
   restore of that state from local memory, from the peer node and from the DCP checkpoint on disk,
   each through relaytrain's own restore path, checked bit-exact: the parameters, AdamW's moments and
   step counters, and the training step.
4. On a CUDA GPU (part `gpu`, in the default parts only where torch sees one): the share of the step a
   snapshot every step blocks, for the 0.4 B-parameter shape bench/gpu_first_hour.py snapshots and for
   the 1B preset (configs/1b.toml, seq 4096, micro batch 2, global batch 8), each against the same run
   without snapshots: the blocking time holds the launch of the device-to-host copies (they run on a side
   stream beside the next step's forward and backward) and any wait for the previous snapshot's
   background work (`snapshot_waited_s`, reported apart); the step time with snapshots includes the next
   optimizer step's wait for copies still running.
Prints a Markdown table for docs/benchmarks.md and keeps the figures in bench/results/snapshot-<UTC date
and time>.json (bench/kept.py; the goodput extrapolation reads its inputs from these files).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("debug", "wide", "state", "nodes", "gpu")
DEBUG = REPO / "configs" / "debug.toml"
# On a GPU: about 0.43 B parameters (12 blocks of dim 1536, a 32k vocabulary; 6.9 GB of fp32 state with
# AdamW; bench/gpu_first_hour.py's snapshot step), and the 1B preset as bench/gpu_mfu.py trains it.
GPU_WIDE = ["--model.dim=1536", "--model.n_layers=12", "--model.n_heads=12", "--model.n_kv_heads=4"]
GPU_WIDE += ["--model.vocab_size=32000", "--model.multiple_of=256", "--train.seq_len=512"]
GPU_WIDE += ["--train.global_batch_size=4", "--train.micro_batch_size=4"]
GPU_SHAPES = {
    "0.4b": (DEBUG, GPU_WIDE),
    "1b": (REPO / "configs" / "1b.toml", ["--train.global_batch_size=8", "--train.micro_batch_size=2",
                                           "--train.seq_len=4096", "--optim.warmup_steps=1"]),
}  # fmt: skip
# The two-node model: the debug config at this width; layers from the state size asked for (12 bytes
# per parameter in the state: fp32 weights and AdamW's two moments, half the model on each rank).
NODES_DIM, PARAMS_PER_LAYER = 1024, 11.6e6


def _train(
    work: Path, name: str, steps: int, every: int, model: list[str], config: Path = DEBUG
) -> list[dict]:
    args = [sys.executable, "-m", "relaytrain.cli", "train", str(config), *model]
    args += [f"--run.dir={work}", f"--run.name={name}", f"--train.max_steps={steps}", "--train.eval_every=0"]
    args += ["--checkpoint.interval=0", "--metrics.log_every=1", "--metrics.tensorboard=false"]
    args += [f"--checkpoint.snapshot_every={every}", f"--checkpoint.snapshot_dir={work / 'shm'}"]
    subprocess.run(args, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = (work / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train" and r["step"] >= 3]


def wide_model(state_gb: float) -> list[str]:
    """The debug config widened to about `state_gb` GB of model and AdamW state in one process."""
    layers = max(1, round(state_gb * 1e9 / 12 / PARAMS_PER_LAYER))
    return [f"--model.dim={NODES_DIM}", f"--model.n_layers={layers}"]


def step_share(steps: int, model: list[str], config: Path = DEBUG, gpu: bool = False) -> dict[str, float]:
    """The run without snapshots and with one every step, side by side (`gpu`: on the CUDA GPU)."""
    model = [*model, "--run.device=cuda", "--data.allow_small=true"] if gpu else model
    # on a GPU the snapshots are gigabytes a step: into node memory, as on a cluster (not the disk)
    shm = "/dev/shm" if gpu and Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        work = Path(tmp)
        plain = _train(work, "plain", steps, 0, model, config)
        snap = _train(work, "snap", steps, 1, model, config)
    blocking = [r["snapshot_blocking_s"] for r in snap[:-1]]  # the last step takes none
    return {
        "step_plain_s": statistics.median(r["time_step_s"] for r in plain),
        "step_snap_s": statistics.median(r["time_step_s"] for r in snap),
        "blocking_s": statistics.median(blocking),
        "blocking_max_s": max(blocking),
        # of the blocking time, the wait for the previous snapshot's background work (not the copy)
        "waited_s": statistics.median(r.get("snapshot_waited_s", 0.0) for r in snap[:-1]),
        "mb": snap[0]["snapshot_bytes"] / 1e6,
    }


def gpu_share(shape: str, steps: int) -> dict[str, float]:
    """`step_share` of a GPU shape (GPU_SHAPES) on the CUDA GPU."""
    config, model = GPU_SHAPES[shape]
    return step_share(steps, model, config, gpu=True)


def gpu_rows(shape: str, r: dict[str, float]) -> list[str]:
    """The GPU part's rows: the step rows, the wait apart, and what the snapshots cost the step."""
    what = f"GPU, {shape} shape ({r['mb'] / 1e3:.2f} GB per rank)"
    copy = r["blocking_s"] - r.get("waited_s", 0.0)
    slower = r["step_snap_s"] / r["step_plain_s"] - 1
    return [
        *step_rows(what, r),
        f"| {what}: of it, the wait for the previous snapshot's background work (median); the rest | "
        f"{r.get('waited_s', 0.0):.4f} s; {copy:.4f} s, {copy / r['step_snap_s']:.1%} of the step |",
        f"| {what}: step with snapshots against without | {slower:+.1%} |",
    ]


def large_state(gb: float) -> dict[str, float]:
    import torch

    from relaytrain.checkpoint.snapshot import store
    from relaytrain.checkpoint.snapshot.format import Staging, decode

    count = max(1, int(gb * 1e9 / 4 / 4_000_000))
    tree = {"model": {f"t{i}": torch.randn(4_000_000) for i in range(count)}}
    staging = Staging()
    staging.stage(tree, {})  # the first one allocates the buffer
    started = time.perf_counter()
    staged = staging.stage(tree, {})
    blocking = time.perf_counter() - started
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        started = time.perf_counter()
        entry = store.write_snapshot(folder, 0, staged.chunks(), {"step": 1})
        written = time.perf_counter() - started
        started = time.perf_counter()
        data = store.read_verified(folder, 0, entry["checksum"])
        decode(data)
        restored = time.perf_counter() - started
    finally:
        shutil.rmtree(folder)
    return {"gb": staged.size / 1e9, "blocking_s": blocking, "write_s": written, "restore_s": restored}


def nodes_layers(state_gb: float) -> int:
    return max(1, round(state_gb * 1e9 * 2 / 12 / PARAMS_PER_LAYER))


def two_nodes(state_gb: float, lock: bool) -> dict:
    """bench/snapshot_nodes.py on 2 nodes x 1 task of the local cluster; its results."""
    sys.path.insert(0, str(REPO))
    from bench.cluster.harness import OUT_ROOT, PROFILE, cluster_lock, relaytrain, start_cluster, wait_job_end

    base = OUT_ROOT / "snapshot" / f"nodes-{int(time.time())}"
    base.mkdir(parents=True)
    out = base / "results.json"
    command = f"cd {REPO} && python -m bench.snapshot_nodes --out {out}"
    overrides = [f"--run.dir={base / 'runs'}", "--run.name=snapshot-nodes", f"--slurm.profile={PROFILE}",
                 f"--model.dim={NODES_DIM}", f"--model.n_layers={nodes_layers(state_gb)}",
                 "--checkpoint.snapshot_every=1", "--checkpoint.mode=sync", "--checkpoint.interval=100",
                 "--train.eval_every=0", "--metrics.tensorboard=false"]  # fmt: skip
    start_cluster(lock=lock)
    try:
        with cluster_lock(lock):
            submitted = relaytrain("launch", str(REPO / "configs/debug.toml"), "--nodes", "2",
                                   "--tasks-per-node", "1", "--command", command, *overrides)  # fmt: skip
            job = re.search(r"submitted job (\d+)", submitted)
            if not job:
                raise RuntimeError(f"no job id in: {submitted}")
            fields = wait_job_end(job.group(1), 900)
        if fields.get("JobState") != "COMPLETED" or not out.is_file():
            logs = "\n".join(p.read_text()[-3000:] for p in (base / "runs").rglob("*.out"))
            raise RuntimeError(f"job {job.group(1)} ended {fields.get('JobState')}:\n{logs}")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(base / "runs" / "snapshot-nodes" / "checkpoints", ignore_errors=True)


def nodes_rows(r: dict) -> list[str]:
    """The two-node part's table rows (Markdown) from bench/snapshot_nodes.py's results."""
    gb = max(r["snapshot_bytes"]) / 1e9
    state = f"2 nodes, {gb:.2f} GB state per rank"
    replicate = max(w["replicate_s"] for w in r["written"])
    sent = max(w["replicated_bytes"] for w in r["written"])
    rows = [
        f"| 2 nodes: model and AdamW state per rank | {gb:.2f} GB ({r['params'] / 1e6:.0f} M parameters) |",
        f"| {state}: blocking copy into the host buffer (the run's first snapshot) | "
        f"{max(r['blocking_s']):.3f} s |",
        f"| {state}: replication to the peer node over gloo (each rank sends its file and receives the "
        f"other's at once) | {replicate:.3f} s, {sent / 1e6 / replicate:.0f} MB/s per direction |",
        f"| {state}: write of its own file and the peer's replica to /dev/shm (background) | "
        f"{max(w['write_s'] for w in r['written']):.3f} s |",
    ]
    where = {
        "local": "restore from local memory (both nodes' snapshots intact)",
        "peer": "restore from the peer node (rank 1's node memory wiped: its file comes from node 0)",
        "dcp": "restore from the DCP checkpoint on disk (both nodes' memory wiped)",
    }
    for restore in r["restores"]:
        notes = [f"step {restore['step']} from the {restore['source']}"]
        notes.append("bit-exact" if restore["bit_exact"] else f"NOT bit-exact{_differs(restore)}")
        if restore["tier"] == "dcp":
            notes.append(f"page cache {'dropped' if restore['page_cache_dropped'] else 'not dropped'}")
            notes.append(f"{restore['snapshot_lookup_s']:.3f} s of it finding no snapshot")
        seconds = f"{restore['restore_s']:.3f} s ({', '.join(notes)})"
        rows.append(f"| {state}: {where[restore['tier']]} | {seconds} |")
    rows.append(f"| {state}: DCP save (sync, for comparison) | {r['dcp_save_s']:.3f} s |")
    return rows


def nodes_figures(r: dict) -> dict[str, float]:
    """The two-node part's figures as kept (the slowest rank of each), from snapshot_nodes.py's results."""
    replicate = max(w["replicate_s"] for w in r["written"])
    figures = {
        "nodes_state_gb": max(r["snapshot_bytes"]) / 1e9,
        "nodes_params": r["params"],
        "nodes_blocking_first_s": max(r["blocking_s"]),
        "replicate_s": replicate,
        "replicate_mb_s": max(w["replicated_bytes"] for w in r["written"]) / 1e6 / replicate,
        "shm_write_s": max(w["write_s"] for w in r["written"]),
        "dcp_save_s": r["dcp_save_s"],
    }
    for restore in r["restores"]:
        if restore["bit_exact"]:  # a restore that did not give the state back is no figure
            figures[f"restore_{restore['tier']}_s"] = restore["restore_s"]
    return figures


def keep(name: str, command: str, parts: dict[str, dict]) -> Path:
    """bench/results/NAME: the command, date, commit and load, every part's results and the figures."""
    sys.path.insert(0, str(REPO))
    from bench import kept
    from bench.report import machine_info

    info = machine_info()
    one_process = [(part, parts.get(part, {})) for part in ("debug", "wide", "state")]
    one_process += [(f"gpu_{shape}", found) for shape, found in parts.get("gpu", {}).items()]
    figures = {f"{part}_{k}": v for part, found in one_process for k, v in found.items()}
    figures |= nodes_figures(parts["nodes"]) if "nodes" in parts else {}
    data = {"command": command, "date": info["date"], "commit": info["commit"], "cpu": info["cpu"],
            **({"gpu": info["gpu"]} if info.get("gpu") else {}),
            "load": f"{info['load_start']} -> {[round(x, 2) for x in os.getloadavg()]}",
            "parts": parts, "figures": figures}  # fmt: skip
    return kept.save(name, data)


def _differs(restore: dict) -> str:
    """What a restore that is not bit-exact got wrong: the model, the optimizer state, the step."""
    wrong = [what for key, what in (("model_exact", "model"), ("optim_exact", "AdamW state"))
             if not restore.get(key, True)]  # fmt: skip
    return f": {' and '.join(wrong)} differ{'s' if len(wrong) == 1 else ''}" if wrong else ""


def step_rows(what: str, r: dict[str, float]) -> list[str]:
    share = r["blocking_s"] / r["step_snap_s"]
    return [
        f"| {what}: step without snapshots (median) | {r['step_plain_s']:.3f} s |",
        f"| {what}: step with `snapshot_every=1` (median) | {r['step_snap_s']:.3f} s |",
        f"| {what}: blocking per snapshot, median (max) | {r['blocking_s']:.4f} s "
        f"({r['blocking_max_s']:.4f} s), {share:.1%} of the step, {r['mb']:.1f} MB per rank |",
    ]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--state-gb", type=float, default=1.2)
    parser.add_argument("--wide-steps", type=int, default=6, help="steps of each widened run")
    parser.add_argument("--gpu-steps", type=int, default=10, help="steps of each GPU run")
    parser.add_argument("--gpu-shapes", default=",".join(GPU_SHAPES), help="GPU part: which shapes")
    parser.add_argument("--parts", default=None, help=f"which of {','.join(PARTS)} to run (gpu: with CUDA)")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster's lock already")
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    parser.add_argument("--keep", default=f"snapshot-{stamp}.json", help="results file in bench/results/")
    parser.add_argument("--no-keep", action="store_true", help="keep no results file (a trial run)")
    args = parser.parse_args()
    parts = args.parts.split(",") if args.parts else [p for p in PARTS if p != "gpu" or _cuda()]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {','.join(PARTS)}")
    print("| measure | value |\n| --- | --- |", flush=True)
    results: dict[str, dict] = {}
    if "debug" in parts:
        results["debug"] = step_share(args.steps, [])
        print("\n".join(step_rows("debug config", results["debug"])), flush=True)
    if "wide" in parts:
        wide = results["wide"] = step_share(args.wide_steps, wide_model(args.state_gb))
        what = f"debug config widened to {wide['mb'] / 1e3:.2f} GB, one process"
        print("\n".join(step_rows(what, wide)), flush=True)
    if "state" in parts:
        large = results["state"] = large_state(args.state_gb)
        gb = f"{large['gb']:.2f} GB state"
        print(f"| {gb}: blocking copy into the host buffer | {large['blocking_s']:.3f} s |")
        print(f"| {gb}: write to /dev/shm with checksum (background) | {large['write_s']:.3f} s |")
        print(f"| {gb}: read, verify and decode (restore) | {large['restore_s']:.3f} s |", flush=True)
    if "nodes" in parts:
        results["nodes"] = two_nodes(args.state_gb, lock=not args.no_lock)
        print("\n".join(nodes_rows(results["nodes"])), flush=True)
    if "gpu" in parts:
        if not _cuda():
            parser.error("--parts gpu: torch sees no CUDA GPU here")
        results["gpu"] = {}
        for shape in args.gpu_shapes.split(","):
            results["gpu"][shape] = gpu_share(shape, args.gpu_steps)
            print("\n".join(gpu_rows(shape, results["gpu"][shape])), flush=True)
    if not args.no_keep:
        command = " ".join(["python bench/snapshot.py", *sys.argv[1:]])
        print(f"results kept in {keep(args.keep, command, results)}")


if __name__ == "__main__":
    main()
