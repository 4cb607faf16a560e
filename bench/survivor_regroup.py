"""Kill -> next collective when the survivors stay: the collective layer of an in-process recovery, alone,
on gloo (no trainer, no model: a state tensor all-reduced once a step).

    python -m bench.survivor_regroup [--ranks 3] [--trials 5] [--kill-at 10] [--steps 30] [--no-write]
    python -m bench.survivor_regroup --page-from bench/results/survivor-regroup-<date>.json

A store process holds a TCPStore (a store no rank owns, so any rank may die). `--ranks` processes build a
gloo group on it under the prefix `gen0`, a warm spare process (torch imported) waits on the store, and
each step every rank all-reduces a tensor of ones and adds it to its state. At step `--kill-at` the last
rank SIGKILLs itself. Each survivor catches the failed collective, destroys its group and builds the next
on the same store under `gen1`; rank 0 names the lost rank there, and the spare takes its place and
receives the state from rank 0 by broadcast; the loop then redoes the failed step. Per trial, from the
processes' own clocks: detect (the kill to a survivor's exception), repair (destroying the group and
building the next), transfer (the broadcast), kill -> the next completed all-reduce, and whether every
rank's final state equals an uninterrupted run's (each step adds `--ranks`). It measures what the survivors
and the spare cost at the collective layer only; the trainer's own path is bench/survivors.py.
Writes the `survivor-regroup` section of docs/benchmarks.md and keeps the figures in
bench/results/survivor-regroup-<UTC date and time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

from bench import kept
from bench.procs import bench_env
from bench.report import REPO, fmt, machine_info, python_command, table

MODULE = "bench.survivor_regroup"
SECTION = "survivor-regroup"
ORDER = ["startup", "compile-restart", SECTION]
TIMEOUT = datetime.timedelta(seconds=20)


def _store(port: int, host: bool):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=host, wait_for_workers=False, timeout=TIMEOUT)


def _group(store, gen: int, rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    dist.init_process_group("gloo", store=PrefixStore(f"gen{gen}", store), rank=rank, world_size=world)


def worker(role: str, rank: int, world: int, port: int, kill_at: int, steps: int) -> None:
    """One rank (`rank`), the spare (`spare`) or the store's host (`store`); prints one JSON line."""
    import torch
    import torch.distributed as dist

    store = _store(port, role == "store")
    if role == "store":
        store.wait(["done"], datetime.timedelta(seconds=300))
        return
    times: dict[str, float] = {}
    gen, step, state = 0, 0, torch.zeros(4)
    if role == "spare":
        store.wait(["gen1/lost"], datetime.timedelta(seconds=300))
        rank, gen = int(store.get("gen1/lost")), 1
        times["join"] = time.time()
        _group(store, gen, rank, world)
        times["joined"] = time.time()
        dist.broadcast(state, src=0)
        step = int(store.get("gen1/step"))
        times["transferred"] = time.time()
    else:
        _group(store, gen, rank, world)
    while step < steps:
        try:
            ones = torch.ones(4)
            dist.all_reduce(ones)
            state += ones
            step += 1
            if "transferred" in times and "next" not in times:
                times["next"] = time.time()
            if role == "rank" and rank == world - 1 and gen == 0 and step == kill_at:
                store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        except RuntimeError:
            times["detected"] = time.time()
            dist.destroy_process_group()
            gen += 1
            if rank == 0:
                store.set("gen1/step", str(step))
                store.set("gen1/lost", str(world - 1))
            _group(store, gen, rank, world)
            times["repaired"] = time.time()
            dist.broadcast(state, src=0)
            times["transferred"] = time.time()
    killed = float(store.get("killed_at"))
    print(json.dumps({"rank": rank, "role": role, "state": state[0].item(), "killed_at": killed, **times}))
    dist.barrier()
    if rank == 0:
        store.set("done", "1")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(ranks: int, kill_at: int, steps: int) -> dict:
    port, env = _free_port(), bench_env(1)
    base = [sys.executable, "-m", MODULE, "--worker"]
    args = [str(ranks), str(port), str(kill_at), str(steps)]
    spawn = lambda role, rank: subprocess.Popen(  # noqa: E731
        [*base, role, str(rank), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    store = spawn("store", -1)
    procs = [spawn("rank", r) for r in range(ranks)] + [spawn("spare", -1)]
    rows = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    store.wait(timeout=60)
    killed = rows[0]["killed_at"]
    survivors = [r for r in rows if r["role"] == "rank"]
    spare = next(r for r in rows if r["role"] == "spare")
    return {
        "detect_s": max(r["detected"] for r in survivors) - killed,
        "repair_s": max(r["repaired"] - r["detected"] for r in survivors),
        "transfer_s": spare["transferred"] - spare["joined"],
        "kill_to_next_s": max(r["next"] for r in rows) - killed,
        "bit_exact": all(r["state"] == ranks * steps for r in rows) and len(rows) == ranks,
        "processes_exited": ranks + 1 - len(rows),
    }


def render(data: dict) -> str:
    trials, m, a = data["trials"], data["machine"], data["args"]

    def row(label: str, key: str) -> tuple:
        values = [t[key] for t in trials]
        return label, fmt(statistics.median(values)), f"{fmt(min(values))} - {fmt(max(values))}"

    rows = [
        row("detect: kill -> a survivor's failed collective", "detect_s"),
        row("repair: a survivor's group destroyed and the next built", "repair_s"),
        row("transfer: the spare, from its group built to the state received", "transfer_s"),
        row("kill -> the next completed all-reduce", "kill_to_next_s"),
    ]
    exact = sum(t["bit_exact"] for t in trials)
    lines = [
        "## Survivors regroup on gloo: the collective layer alone",
        "",
        f"{m['date']}, {m['cpu']} ({m['cores']} cores, load {m['load_start']} at the start), "
        f"torch {m['torch']}, commit {m['commit']}. {a['ranks']} ranks and a warm spare on one machine, "
        f"the last rank SIGKILLed at step {a['kill_at']} of {a['steps']}, {len(trials)} trials. "
        f"Command: `{data['command']}`.",
        "",
        table(["interval", "median (s)", "range (s)"], rows).rstrip(),
        "",
        f"Final state equal to an uninterrupted run's on every rank: {exact} of {len(trials)} trials; "
        f"processes that exited besides the killed one: {sum(t['processes_exited'] - 1 for t in trials)}. "
        "No model, no optimizer, no data: the trainer's own path (a replacement process, no warm spare) "
        "is the next section's.",
        "",
    ]
    return "\n".join(lines) + "\n" + kept.rewritten(python_command(MODULE), kept.relative(data["kept"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        role, rank, ranks, port, kill_at, steps = argv[1], *map(int, argv[2:])
        worker(role, rank, ranks, port, kill_at, steps)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--page-from", default="")
    args = parser.parse_args(argv)
    if args.page_from:
        kept.rewrite_from(args.page_from, render, SECTION, ORDER, parser.error)
        return 0
    shown = [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("no_write", "page_from")
    ]
    data = {"machine": machine_info(), "command": python_command(MODULE, shown), "args": vars(args)}
    data["trials"] = [trial(args.ranks, args.kill_at, args.steps) for _ in range(args.trials)]
    kept.keep_and_show("survivor-regroup", data, render, SECTION, ORDER, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
