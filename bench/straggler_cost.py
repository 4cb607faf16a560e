"""What straggler detection costs a step, measured inside the run it watches (`python -m bench.stragglers`
starts it under torchrun, 2 ranks on this machine).

Every rank wraps the straggler's share of its step clock: the time spent entering and leaving the clock's
`alone()` (the timing around the optimizer update, not the update itself), in the hooks around each timed
module's forward (the forward phase: `StepClock.time_alone`), in the watch's `alone()` (each piece of alone
work it is handed, the data section's included) and in its `step_done()` (every step's bookkeeping and,
every window, the all-gather, the verdict and rank 0's records) is summed, beside the same run's own step
time. The wrapper's own clock reads are counted too; PyTorch's own dispatch of a module's hooks is not.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.straggler_cost OUT.json STEPS
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from relaytrain.job.clock import StepClock
from relaytrain.resilience.rank.straggler_watch import StragglerWatch

SPENT = [0.0]


def _instrument() -> None:
    alone = StepClock.alone

    @contextlib.contextmanager
    def timed_alone(self):
        start = time.perf_counter()
        inner = alone(self)
        inner.__enter__()
        SPENT[0] += time.perf_counter() - start
        try:
            yield
        finally:
            start = time.perf_counter()
            inner.__exit__(None, None, None)
            SPENT[0] += time.perf_counter() - start

    def timed(method):
        def wrapper(self, *args):
            start = time.perf_counter()
            method(self, *args)
            SPENT[0] += time.perf_counter() - start

        return wrapper

    StepClock.alone = timed_alone
    for name in ("_forward_begin", "_forward_end"):  # the hooks: looked up when registered
        setattr(StepClock, name, timed(getattr(StepClock, name)))
    for name in ("alone", "step_done"):  # looked up when the watch becomes the clock's reader
        setattr(StragglerWatch, name, timed(getattr(StragglerWatch, name)))


def main(out: str, steps: int) -> None:
    import torch.distributed as dist

    from relaytrain.config.loader import load_config
    from relaytrain.trainer import train

    run_dir = Path(out).with_suffix("")
    overrides = ["--model.dim=128", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                 "--model.vocab_size=320", "--train.seq_len=64", "--train.global_batch_size=8",
                 "--train.micro_batch_size=4", "--train.eval_every=0", "--metrics.log_every=10",
                 "--metrics.tensorboard=false", "--checkpoint.enabled=false", f"--train.max_steps={steps}",
                 f"--run.dir={run_dir}", "--run.name=cost"]  # fmt: skip
    _instrument()
    cfg = load_config(None, overrides)
    started = time.perf_counter()
    original_destroy = dist.destroy_process_group
    results: dict = {}

    def report_then_destroy(*args, **kwargs):  # the spent times of both ranks, before the group goes
        import torch

        spent = torch.tensor([SPENT[0]], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, spent)
        results["spent_s"] = [float(t) for t in every]
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = report_then_destroy
    code = train(cfg)
    wall = time.perf_counter() - started
    if results and dist.is_available() and int(__import__("os").environ.get("RANK", "0")) == 0:
        records = [json.loads(line) for line in (run_dir / "cost" / "metrics.jsonl").read_text().splitlines()]
        step_s = [r["time_step_s"] for r in records if r.get("kind") == "train" and r["step"] > 10]
        mean_step = sum(step_s) / len(step_s)
        per_step = max(results["spent_s"]) / steps
        Path(out).write_text(json.dumps({"steps": steps, "exit_code": code, "wall_s": round(wall, 2),
                                         "mean_step_s": mean_step, "cost_per_step_s": per_step,
                                         "cost_share": per_step / mean_step,
                                         "spent_s_per_rank": results["spent_s"]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
