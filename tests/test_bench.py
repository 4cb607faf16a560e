"""The benchmark tooling stays working: page merging, section rendering from fake results, output parsers.

No timings are asserted; the figures themselves live on docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import checkpoint_section, gpu_mfu, matmul_peak, overhead, startup, torchtitan_gpu  # noqa: E402
from bench.__main__ import ORDER, links_section  # noqa: E402
from bench.report import (  # noqa: E402
    block,
    fmt,
    merge_page,
    render_machine,
    section_body,
    section_names,
    write_page,
)

FOREIGN_PAGE = """# Benchmarks

Intro written by hand.

<!-- bench:overhead -->
## old overhead text
<!-- /bench:overhead -->

## Slurm end to end

Measured by a colleague, no markers: must survive untouched.

<!-- bench:checkpoint-io -->
## Checkpoint I/O (written by the checkpoint script)
<!-- /bench:checkpoint-io -->
"""


def fake_overhead() -> dict:
    runs = []
    for i in range(2):
        runs.append(
            {
                "side": "plain",
                "order": 2 * i,
                "command": "python -m bench.plain_loop --steps=5",
                "step_s": [0.30, 0.31, 0.29],
                "forward_backward_s": 0.27,
                "optimizer_s": 0.02,
                "threads": 2,
                "tokens_per_step": 2048,
            }
        )
        runs.append(
            {
                "side": "relaytrain",
                "order": 2 * i + 1,
                "command": "relaytrain train --x=1",
                "step_s": [0.31, 0.32, 0.30],
                "trainer_mfu": 0.2,
                "data_s": 0.001,
                "forward_backward_s": 0.28,
                "optimizer_s": 0.02,
                "checkpoint_s": 0.0,
                "other_s": 0.003,
            }
        )
    result = {
        "command": "python -m bench.overhead --pairs=2",
        "threads": 2,
        "pairs": 2,
        "steps": 8,
        "warmup": 2,
        "overrides": [],
        "model": {"dim": 256, "n_layers": 4, "vocab_size": 320, "params": 3_000_000},
        "batch": {"global": 16, "micro": 8, "seq_len": 128},
        "tokens_per_step": 2048,
        "flops_per_token": 2.0e7,
        "peak_flops": 1.0e11,
        "runs": runs,
        "profile": {
            "command": "python -m cProfile ...",
            "steps": 8,
            "profiled_step_s": 0.4,
            "self_total_s": 0.004,
            "functions": [
                {"function": "monitor.metrics.log_train", "calls": 8, "cum_s": 0.002, "self_s": 0.0001}
            ],
        },
    }
    return result | overhead.summarise(result)


def test_merge_replaces_own_blocks_and_keeps_everything_else():
    page = merge_page(FOREIGN_PAGE, {"overhead": "## new overhead", "startup": "## startup"}, ORDER)
    assert "## new overhead" in page and "old overhead text" not in page
    assert "Measured by a colleague, no markers: must survive untouched." in page
    assert "## Checkpoint I/O (written by the checkpoint script)" in page
    assert "Intro written by hand." in page
    # the new block goes right after the block that precedes it in ORDER
    assert section_names(page) == ["overhead", "startup", "checkpoint-io"]
    assert page.index("## startup") < page.index("## Slurm end to end")
    # merging is idempotent and a second run replaces, never duplicates
    again = merge_page(page, {"overhead": "## new overhead", "startup": "## startup"}, ORDER)
    assert again == page


def test_new_blocks_without_an_earlier_neighbour_go_before_a_later_one():
    page = merge_page(FOREIGN_PAGE, {"usage": "## usage", "checkpoint-io-run": "### run"}, ORDER)
    assert section_names(page) == ["usage", "overhead", "checkpoint-io", "checkpoint-io-run"]
    assert page.index("Intro written by hand.") < page.index("## usage")
    assert (
        section_body(page, "checkpoint-io").strip() == "## Checkpoint I/O (written by the checkpoint script)"
    )


def test_merge_into_empty_page_creates_title_and_ordered_blocks(tmp_path):
    path = tmp_path / "benchmarks.md"
    write_page({"startup": "## s", "machine": "m", "overhead": "## o"}, ORDER, path)
    text = path.read_text()
    assert text.startswith("# Benchmarks")
    assert section_names(text) == ["machine", "overhead", "startup"]
    assert section_body(text, "overhead").strip() == "## o"
    write_page({"overhead": "## o2"}, ORDER, path)
    assert section_body(path.read_text(), "overhead").strip() == "## o2"
    assert block("x", "body\n\n").endswith("body\n<!-- /bench:x -->\n")


def test_the_overhead_verdict_comes_from_the_pairs_spread_not_from_one_point_estimate():
    """met: the median pair overhead's 95 % upper bound (sign test) at or under 3 %; missed: its lower bound
    over 3 %; not shown: the bounds straddle 3 % (noise larger than the margin) or under 5 pairs."""
    from bench.overhead_page import judged

    assert judged([0.0, 0.01, 0.02, 0.01, 0.025])["verdict"] == "met"
    assert judged([0.0, 0.01, 0.02, 0.01, 0.031])["verdict"] == "not shown"  # one pair over: the max bounds
    assert judged([0.04, 0.05, 0.06, 0.07, 0.031])["verdict"] == "missed"
    assert judged([0.04, 0.05, 0.06, 0.07, 0.03])["verdict"] == "not shown"
    assert judged([-0.5, -0.5, -0.5, -0.5])["verdict"] == "not shown"  # 4 pairs: no 95 % bound
    eight = judged([0.08, -0.1, 0.0, 0.01, 0.02, 0.025, 0.015, 0.005])  # 8 pairs: the 2nd largest bounds
    assert (eight["verdict"], eight["high"], eight["low"]) == ("met", 0.025, 0.0)
    assert round(eight["confidence"], 4) == round(247 / 256, 4)
    result = fake_overhead()
    result["summary"]["pair_overheads"] = [0.0, 0.01, 0.02, 0.01, 0.025]
    assert "target ≤ 3%: **met**: the median pair overhead lies between +0.0% and +2.5%" in overhead.render(
        result
    )


def test_rendering_fake_results():
    text = overhead.render(fake_overhead())
    assert "+3.3%" in text  # 0.31 / 0.30 - 1
    # two pairs at +3.3 %: over the target, but two pairs bound nothing: no verdict from one point estimate
    assert "target ≤ 3%: **not shown**: 2 pair(s) of runs give no bound" in text
    assert "**missed**" not in text and "**met**" not in text and "monitor.metrics.log_train" in text
    assert "relaytrain train --x=1" in text

    fresh = [{"to_setup_s": 3.0, "to_first_step_s": 4.0, "first_step_s": 1.0, "wall_s": 6.0}]
    resumed = [{"to_setup_s": 3.5, "to_first_step_s": 3.9, "first_step_s": 0.4, "wall_s": 5.0}]
    text = startup.render(
        {
            "command": "python -m bench.startup",
            "job_command": "relaytrain train",
            "threads": 2,
            "repeats": 1,
            "stop_at": 2,
            "heaviest_imports": [{"module": "torch.distributed.checkpoint", "cumulative_s": 0.9}],
            "samples": {
                "imports": [{"interpreter_s": 0.1, "torch_s": 1.5, "relaytrain_s": 0.5}],
                "fresh": fresh,
                "resume": resumed,
            },
        }
    )
    assert "first resumed step done | 3.90" in text
    assert "relaytrain's own imports 0.500 s, set-up (config" in text
    assert ") 0.900 s, first step 1.00 s" in text
    assert "| `torch.distributed.checkpoint` | 0.900 |" in text

    rows = [
        {
            "size": 1024,
            "dtype": "float32",
            "device": "cpu",
            "threads": 2,
            "best_flops": 1.3e11,
            "median_flops": 1.2e11,
            "samples": 10,
        },
        {
            "size": 512,
            "dtype": "bfloat16",
            "device": "cpu",
            "threads": 2,
            "best_flops": 1e9,
            "median_flops": 1e9,
            "samples": 5,
        },
    ]
    text = matmul_peak.render(
        {
            "command": "python -m bench.matmul_peak",
            "cores": 2,
            "rows": rows,
            "cpu_peak_flops": 1.3e11,
            "gpu_peak_flops": None,
        }
    )
    assert "130" in text and "not measured" in text

    numbers = {
        "checkpoint_bytes": 1e9,
        "disk_write_Bps": 1e9,
        "disk_read_Bps": 2e9,
        "sync_save": 1.1,
        "async_block": 0.05,
        "async_total": 1.5,
        "load": 0.5,
    }
    text = checkpoint_section.render(  # a results.json written before several runs were measured
        {"command": "python bench/checkpoint_io.py", "markdown": "| t |", "numbers": numbers}
    )
    assert "| sync save throughput / disk write | ≥ 80% | 91% | **met** |" in text
    assert "| async save blocking time / sync save time | ≤ 10% | 5% | **met** |" in text
    assert "Missed: async save throughput" in text
    slow = dict(numbers, sync_save=1.4, async_idle_total=1.2, fresh_read_Bps=2.5e9, load_unverified=0.45)
    slow |= {"cpu_s": {"sync_save": 1.2, "train_step": 1.0}, "cores": 2}
    text = checkpoint_section.render({
        "command": "python bench/checkpoint_io.py", "max_load": 1.5, "profile": None,
        "runs": [{"markdown": "| a |", "numbers": numbers, "load_start": 0.4},
                 {"markdown": "| b |", "numbers": slow, "load_start": 1.2}],
    })  # fmt: skip
    assert "(2 runs, each started once the 1-minute load average was below 1.5)" in text
    assert "| b |" in text and "| a |" not in text  # the last run's own table
    assert "| sync save throughput / disk write | ≥ 80% | 91% | 71% | **missed** (1 of 2) |" in text
    assert "load average at each run's start: 0.4, 1.2" in text
    assert "| load time / floor (uncached read into fresh memory) | – | 1.25 |" in text  # run 2 only
    assert "| async save until committed / CPU floor ((sync save + step CPU s) / cores) | – | 1.36 |" in text

    assert "**Not run**" in torchtitan_gpu.render(torchtitan_gpu.not_run())
    assert "**Not run**" in gpu_mfu.render(gpu_mfu.not_run())
    info = {
        "date": "2026-01-01 00:00 UTC",
        "cpu": "X",
        "cpu_capability": "AVX2",
        "cores": 2,
        "torch_threads": 2,
        "memory_gib": 4.0,
        "gpu": None,
        "python": "3.11",
        "torch": "2.13",
        "load_start": [5.0, 1, 1],
    }
    text = render_machine(info, "python -m bench", [1.0, 1.0, 1.0])
    assert "exceeded the core count" in text and "`python -m bench`" in text
    assert "parallel_layouts" in links_section()


def test_fmt():
    assert fmt(0.123456) == "0.123" and fmt(1234.5) == "1,234" and fmt(12.345) == "12.3"
    assert fmt(math.nan) == "–" and fmt(None) == "–"


def test_parse_torchtitan_console_lines():
    log = (
        "[rank0]:[titan] 2026 - root - INFO - Model llama3 debugmodel size: 6,139,136 total parameters\n"
        "[rank0]:[titan] INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.1200  \x1b[38;2;180;60;0mgrad_norm:  1.5  "
        "\x1b[36mmemory:  1.20GiB(1.51%)  \x1b[34mtps: 1,234  \x1b[36mtflops: 0.05  "
        "\x1b[35mmfu: 0.01%\x1b[39m\n"
        "[rank0]:[titan] INFO - step:  2  loss:  7.0  grad_norm:  1.0  memory:  1.2GiB(1.5%)  tps: 45,678  "
        "tflops: 1.23  mfu: 12.50%\n"
    )
    steps, params = torchtitan_gpu.parse_titan(log)
    assert params == 6_139_136
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["tps"] == 45678 and steps[1]["mfu"] == pytest.approx(0.125)


def test_plain_loop_trains_the_configured_model():
    from bench.plain_loop import run

    tiny = [
        "--model.dim=32",
        "--model.n_layers=1",
        "--model.n_heads=2",
        "--model.n_kv_heads=1",
        "--train.seq_len=16",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=2",
    ]
    out = run(3, tiny, peak_seconds=0.1, data="random")
    assert len(out["step_s"]) == len(out["forward_backward_s"]) == 3
    assert out["tokens_per_step"] == 64
    assert math.isfinite(out["loss_first"]) and math.isfinite(out["loss_last"])
    # the trainer's device and precision (CPU here: fp32, no autocast)
    assert (out["device"], out["dtype"]) == ("cpu", "float32")


def test_plain_loop_takes_the_trainers_device_and_precision():
    from relaytrain.config import load_config

    from bench.plain_loop import device_and_precision

    device, dtype, autocast = device_and_precision(load_config(None, ["--parallel.param_dtype=bfloat16"]))
    assert device.type == "cpu" and dtype == torch.bfloat16
    with autocast():
        assert torch.is_autocast_enabled("cpu")  # as ParallelModel without FSDP
    device, dtype, autocast = device_and_precision(load_config(None, ["--run.device=cpu"]))
    with autocast():
        assert dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def test_torchtitan_8b_preset_is_the_8b_shape_on_eight_gpus(tmp_path):
    from relaytrain.config import load_config
    from relaytrain.model import count_parameters

    preset = torchtitan_gpu.PRESETS["8b"]
    ours = torchtitan_gpu.relaytrain_gpu_argv(preset, 8, tmp_path, "x", 30, preset.seq, preset.batch)
    overrides = ours[ours.index("train") + 1 :]
    cfg = load_config(None, overrides)
    assert 8.0e9 < count_parameters(cfg.model) < 8.1e9  # Llama 3.1 8B: 8.03 B
    assert "--nproc_per_node=8" in ours and cfg.train.global_batch_size == 8 and cfg.train.seq_len == 8192
    assert cfg.parallel.activation_checkpointing == "selective" and cfg.parallel.param_dtype == "bfloat16"
    titan = torchtitan_gpu.titan_argv(preset, 8, 30, preset.seq, preset.batch, [])
    assert titan[titan.index("--config") + 1] == "llama3_8b"
    assert titan[-1] == "activation-checkpoint:selective"
    assert "--parallelism.data_parallel_shard_degree=8" in titan


def test_torchtitan_before_0_3_gets_its_own_flags(monkeypatch):
    """0.3.0 needs a torch newer than 2.11; 0.2.x names the model by flavour and has no --config."""
    monkeypatch.setattr(torchtitan_gpu, "titan_release", lambda: (0, 2, 2))
    debug, big = torchtitan_gpu.PRESETS["debug"], torchtitan_gpu.PRESETS["8b"]
    one = torchtitan_gpu.titan_argv(debug, 1, 30, 2048, 8, ["--x=1"])
    assert "--config" not in one and "--model.flavor=debugmodel" in one and one[-1] == "--x=1"
    assert {"--training.steps=30", "--training.mixed_precision_param=float32"} <= set(one)
    eight = torchtitan_gpu.titan_argv(big, 8, 30, 8192, 1, [])
    assert "--model.flavor=8B" in eight and "--activation_checkpoint.mode=selective" in eight
    assert "--parallelism.data_parallel_shard_degree=8" in eight


def test_step_ab_times_both_step_functions_in_one_process():
    from bench.step_ab import run

    tiny = [
        "--model.dim=32",
        "--model.n_layers=1",
        "--model.n_heads=2",
        "--model.n_kv_heads=1",
        "--train.seq_len=16",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=2",
    ]
    out = run(2, tiny, data="random")
    assert len(out["plain"]) == len(out["relaytrain"]) == 2


def _kept_run(date: str, load: float) -> dict:
    return {
        "machine": {
            "date": date,
            "cpu": "X",
            "cores": 2,
            "torch_threads": 2,
            "memory_gib": 4.0,
            "gpu": None,
            "python": "3.11",
            "torch": "2.13",
            "load_start": [load, 0.5, 0.5],
        },
        "command": "python -m bench --quick",
        "load_end": [0.4, 0.4, 0.4],
        "overhead": fake_overhead(),
        "torchtitan": torchtitan_gpu.not_run(),
        "gpu": gpu_mfu.not_run(),
    }


def test_page_from_renders_the_cpu_sections_from_every_kept_run_latest_first(tmp_path, monkeypatch):
    from bench import __main__ as runner
    from bench import kept

    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    first, second = _kept_run("2026-01-01 10:00 UTC", 0.5), _kept_run("2026-01-02 11:00 UTC", 7.5)
    first["startup"] = {"fake": 1}  # only the first run measured startup
    kept.save("bench-2026-01-01-1000.json", first)
    kept.save("bench-2026-01-02-1100.json", second)
    monkeypatch.setitem(runner.RENDERERS, "startup", lambda result: f"## startup\n\nfake {result['fake']}\n")
    paths = runner.kept_runs()
    assert [p.name for p in paths] == ["bench-2026-01-01-1000.json", "bench-2026-01-02-1100.json"]
    sections = runner.render_kept(paths)
    assert set(sections) == {"machine", "overhead", "startup"}  # the GPU sections are not these runs'
    rewritten = f"`python -m bench --page-from {paths[0]} {paths[1]}`"
    for body in sections.values():
        assert f"Rewritten from the kept results by {rewritten}." in body
    machine = sections["machine"]
    assert (
        machine.index("2026-01-02 11:00 UTC")
        < machine.index("**An earlier run**")
        < machine.index("2026-01-01 10:00 UTC")
    )
    assert "The load average exceeded the core count" in machine  # the second run's load, said
    assert sections["overhead"].count("## Framework overhead") == 1  # one heading, two runs
    assert sections["overhead"].count("**An earlier run**") == 1
    assert sections["startup"].startswith("## startup\n\nResults:") and "fake 1" in sections["startup"]
    assert "Measured 2026-01-01 10:00 UTC by `python -m bench --quick`" in sections["startup"]
    assert "The pairs disagree" not in sections["overhead"]  # fake pairs agree within 6 points


def test_a_run_keeps_its_results_and_renders_its_sections_from_the_kept_file(tmp_path, monkeypatch, capsys):
    from bench import __main__ as runner
    from bench import kept

    monkeypatch.setattr(runner, "WORK", tmp_path)
    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setitem(runner.SECTIONS, "checkpoint-io-run", lambda plan: ({"x": 1}, "### fake run"))
    monkeypatch.setitem(runner.RENDERERS, "checkpoint-io-run", lambda result: f"### fake run {result['x']}")
    page = tmp_path / "page.md"
    assert runner.main(["--only", "checkpoint-io", "--page", str(page), "--no-write"]) == 0
    out = capsys.readouterr().out
    (saved,) = (tmp_path / "results").glob("bench-*.json")
    assert json.loads(saved.read_text())["checkpoint-io-run"] == {"x": 1}
    assert json.loads((tmp_path / "results.json").read_text())["checkpoint-io-run"] == {"x": 1}
    assert f"### fake run 1\n\nResults: `{saved}`. Rewritten from the kept results by" in out
    with pytest.raises(SystemExit):
        runner.main(["--only", "checkpoint-iox", "--page", str(page), "--no-write"])
    assert runner.main(["--page-from", str(saved), "--page", str(page)]) == 0
    assert "### fake run 1" in page.read_text() and "| cores |" in page.read_text()


def test_gpu_first_hour_without_a_gpu_says_so_in_one_line_and_exits_0():
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run for an hour")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repository itself
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bench/gpu_first_hour.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu_first_hour: no CUDA GPU on this machine; nothing to do"]
    assert proc.stderr == ""


def test_gpu_first_hour_renders_its_section_with_date_device_and_failures(tmp_path):
    from bench import gpu_first_hour

    result = {
        "date": "2026-11-25 18:00 UTC",
        "device": "NVIDIA H100 80GB HBM3",
        "steps": {
            "matmul": {"ok": True, "figures": {"bf16_8192_tflops": 712.5}, "seconds": 3.0},
            "layouts": {"ok": True, "figures": {"diff_vs_fsdp": {"tp": 0.001}}, "seconds": 300.0},
            "compile": {"ok": False, "error": "FailOnRecompileLimitHit", "seconds": 40.0},
        },
    }
    text = gpu_first_hour.render(result)
    assert "2026-11-25 18:00 UTC" in text and "NVIDIA H100 80GB HBM3" in text
    assert "bf16_8192_tflops: 712" in text and "**failed**: FailOnRecompileLimitHit" in text
    assert "0 recompiles" in text  # what to look for, beside the figures
    page = tmp_path / "benchmarks.md"
    write_page({gpu_first_hour.SECTION: text}, path=page)
    assert section_body(page.read_text(), "gpu-first-hour").strip() == text.strip()
    assert gpu_first_hour.main(["--only", "nope"]) in (0, 2)  # 0 without a GPU, 2 (unknown step) with one


def test_simulated_section_is_what_its_generator_writes_from_the_kept_outputs():
    """docs/benchmarks.md's "Simulated at scale" is bench.simulated_table's rendering of the kept
    `plan --simulate --json` outputs, byte for byte: no hand edit, no figure without a kept output."""
    from bench.report import PAGE, section_body
    from bench.simulated_table import SECTION, render

    body = section_body(PAGE.read_text(), SECTION)
    assert body is not None, "the page lacks the <!-- bench:simulated --> block"
    assert body.rstrip() == render().rstrip(), "rerun: python -m bench.simulated_table"


def test_simulated_rows_without_a_kept_output_are_named_not_shown(tmp_path):
    import shutil

    from bench.simulated_rows import ROWS
    from bench.simulated_table import RESULTS, kept, render

    have = next(r for r in ROWS if kept(r) is not None and kept(r)[0]["ranks"])
    lacking = next(r for r in ROWS if r.id != have.id)
    for suffix in (".json", ".run.json"):
        shutil.copy(RESULTS / f"{have.id}{suffix}", tmp_path / f"{have.id}{suffix}")
    text = render(tmp_path, [have, lacking])
    table_lines = [line for line in text.splitlines() if line.startswith("| `")]
    assert any(f"`{have.id}`" in line for line in table_lines)
    assert not any(f"`{lacking.id}`" in line for line in table_lines)
    (missing,) = [line for line in text.splitlines() if line.startswith("Not reproduced here")]
    assert f"`{lacking.id}`" in missing and f"`{have.id}`" not in missing
    record = kept(have)[0]
    rank = max(record["ranks"], key=lambda r: r["peak_bytes"])
    grads = next(c for c in rank["detail_comparison"] if c["category"] == "gradients")
    assert f"{grads['plan_bytes'] / 1024**3:.2f} / {grads['simulated_bytes'] / 1024**3:.2f}" in text


def test_kept_simulations_carry_the_plan_that_plan_computes_now():
    """A kept output's plan side must be today's plan: a formula change re-simulates its rows (or the
    table would show yesterday's plan against the simulation)."""
    from relaytrain.config import load_config
    from relaytrain.plan.checks import make_plan
    from relaytrain.plan.compare import plan_detail

    from bench.simulated_rows import ROWS
    from bench.simulated_table import REPO, kept

    checked = 0
    for row in ROWS:
        found = kept(row)
        if found is None or not found[0]["ranks"]:
            continue
        plan = make_plan(load_config(REPO / row.config, row.config_overrides), row.nodes, row.gpus, "h100")
        now, then = plan_detail(plan), found[0]["plan_detail_bytes"]
        assert now == pytest.approx(then, rel=1e-9), f"rerun: python -m bench.simulated_table --run {row.id}"
        checked += 1
    assert checked >= 10
