"""Metrics: throughput/MFU arithmetic, step timer, JSONL/TensorBoard/W&B sinks, console, rank logs,
profiler."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import types
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from relaytrain.config.schema import Config
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase
from relaytrain.monitor import mfu as mfu_mod
from relaytrain.monitor import timer as timer_mod
from relaytrain.monitor.logs import setup_logging
from relaytrain.monitor.memory import memory_stats
from relaytrain.monitor.metrics import MetricsLogger, format_train_line
from relaytrain.monitor.mfu import Peak, lookup_gpu_peak_flops, mfu, peak_flops_per_device, throughput
from relaytrain.monitor.profiler import StepProfiler, classify_op, dump_memory_snapshot, record_memory_history
from relaytrain.monitor.sinks import ConsoleSink
from relaytrain.monitor.timer import StepTimer


def _cfg(**metrics) -> Config:
    cfg = Config()
    cfg.train.global_batch_size = 16
    cfg.train.seq_len = 128
    cfg.train.max_steps = 100
    cfg.metrics.tensorboard = False
    cfg.metrics.peak_flops = 1e12
    for key, value in metrics.items():
        setattr(cfg.metrics, key, value)
    return cfg


def _logger(cfg: Config, run_dir: Path, is_main: bool, world_size: int = 1, **kwargs) -> MetricsLogger:
    return MetricsLogger(
        cfg.metrics,
        RunDir(run_dir),
        is_main,
        device=torch.device("cpu"),
        world_size=world_size,
        total_steps=cfg.train.max_steps,
        tokens_per_step=cfg.train.global_batch_size * cfg.train.seq_len,
        flops_per_token=kwargs.pop("flops_per_token", 1e6),
        run_name=cfg.run.name,
        run_config=asdict(cfg),
        **kwargs,
    )


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- throughput and MFU -------------------------------------------------------------------------


def test_throughput_and_mfu_arithmetic():
    total, per_device = throughput(tokens=16 * 2048, seconds=0.5, world_size=8)
    assert total == 65536.0 and per_device == 8192.0
    # 8192 tok/s/device * 6e9 FLOPs/token = 4.9152e13 FLOP/s on a 989 TFLOP/s H100
    assert mfu(8192.0, 6e9, 989e12) == pytest.approx(4.9152e13 / 989e12)
    assert mfu(8192.0, 6e9, 989e12) == pytest.approx(0.049699, abs=1e-6)
    assert math.isnan(mfu(8192.0, 6e9, 0.0))
    assert math.isnan(throughput(100, 0.0, 1)[0])


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("AMD Instinct MI250X", 191.5e12),
        ("AMD Instinct MI250X / MI250", 191.5e12),
        ("NVIDIA GeForce GTX 1080", 0.0),
    ],
)
def test_gpu_peak_table(name, peak):
    assert lookup_gpu_peak_flops(name) == peak


def test_peak_flops_per_device_names_its_source(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peak_flops_per_device(torch.device("cpu"), override=5e11) == Peak(5e11, "from metrics.peak_flops")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    peak = peak_flops_per_device(torch.device("cuda", 0))
    assert peak.flops == 756e12 and "table" in peak.source and "H100 PCIe" in peak.source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    assert peak_flops_per_device(torch.device("cuda", 0)).flops == 0.0


def test_cpu_peak_is_measured_once_per_machine_and_then_stable(monkeypatch, tmp_path):
    """Every job of a run (and every run) on one machine divides by the same figure: re-measuring under
    the load of the moment made MFU jump between the jobs of one run (31 % -> 13 %)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rates = iter([1.8e11, 4.0e11, 1.9e11])  # what measuring again would have given
    monkeypatch.setattr(mfu_mod, "measure_cpu_peak_flops", lambda seconds: next(rates))
    cache = tmp_path / "relaytrain" / "cpu_peak.json"
    peaks = [peak_flops_per_device(torch.device("cpu")) for _ in range(3)]
    assert [p.flops for p in peaks] == [1.8e11] * 3 and all(p.estimate for p in peaks)
    assert f"cached in {cache}" in peaks[0].source and "MFU is an estimate" in peaks[2].source
    assert mfu_mod.cpu_capability() in peaks[0].source
    assert f"{torch.get_num_threads()} threads" in peaks[0].source
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["flops"] == 1.8e11
    # Another thread count is another machine as far as the peak goes.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert peak_flops_per_device(torch.device("cpu")).flops == 4.0e11
    assert len(json.loads(cache.read_text())) == 2


def test_cpu_mfu_is_an_estimate_never_above_100_percent(monkeypatch, tmp_path):
    """A peak measured on a busy machine is too low: the window that beats it raises it (and the cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mfu_mod, "measure_cpu_peak_flops", lambda seconds: 1e6)  # measured under load
    logger = _logger(_cfg(peak_flops=0.0), tmp_path / "run", True, flops_per_token=1e6, progress_bar=False)
    first = logger.derive({"loss": 1.0}, tokens=3, seconds=1.0)  # 3e6 FLOP/s achieved > 1e6 "peak"
    second = logger.derive({"loss": 1.0}, tokens=1.5, seconds=1.0)
    logger.close()
    assert (first["mfu"], first["mfu_estimate"]) == (1.0, True)
    assert second["mfu"] == pytest.approx(0.5)
    assert peak_flops_per_device(torch.device("cpu")).flops == 3e6  # the next run starts from it
    gpu = _logger(_cfg(peak_flops=1e6), tmp_path / "gpu", True, world_size=1, flops_per_token=1e6,
                  progress_bar=False)  # fmt: skip
    assert "mfu_estimate" not in gpu.derive({"loss": 1.0}, tokens=1, seconds=1.0)  # a datasheet figure
    gpu.close()


def test_mfu_above_one_warns_once_naming_the_peak_source(tmp_path, caplog):
    logger = _logger(
        _cfg(peak_flops=1e6), tmp_path, True, world_size=1, flops_per_token=1e6, progress_bar=False
    )
    with caplog.at_level("WARNING", logger="relaytrain"):
        logger.log_train(1, {"loss": 1.0}, tokens=10, seconds=1.0)
        logger.log_train(2, {"loss": 1.0}, tokens=10, seconds=1.0)
    logger.close()
    warnings = [r.getMessage() for r in caplog.records if "above 100%" in r.getMessage()]
    assert len(warnings) == 1 and "from metrics.peak_flops" in warnings[0]


def test_memory_stats_cpu():
    stats = memory_stats(torch.device("cpu"))
    assert stats["mem_peak_gib"] > 0
    if Path("/proc/self/status").exists():
        assert 0 < stats["mem_rss_gib"] <= stats["mem_peak_gib"] + 1e-6


# --- step timer ---------------------------------------------------------------------------------


def test_step_timer_windows(monkeypatch):
    """The metrics' phase times read the step clock's sections (its one timer), by phase."""
    clock = [100.0]
    monkeypatch.setattr(timer_mod.time, "perf_counter", lambda: clock[0])
    steps = StepClock()
    timer = StepTimer()
    steps.add_reader(timer)
    clock[0] = 150.0  # startup before the first section is not step time
    with steps.section(Phase.CHECKPOINT_LOAD):  # a restore before the first step: start-up too
        clock[0] += 7.0
    for _ in range(2):
        with steps.section(Phase.DATA):  # each data section starts a step
            clock[0] += 0.5
        with steps.section(Phase.FORWARD_BACKWARD):
            clock[0] += 2.0
        with steps.section(Phase.OPTIMIZER):
            clock[0] += 1.0
        clock[0] += 0.5  # untimed work: "other"
    with steps.section(Phase.EVALUATION):  # left out of the step time
        clock[0] += 30.0
    with steps.section(Phase.CHECKPOINT_SAVE):
        clock[0] += 3.0
    with steps.section(Phase.SNAPSHOT):
        clock[0] += 1.0
    window = timer.window()
    assert window["data"] == 0.5 and window["forward_backward"] == 2.0
    assert window["optimizer"] == 1.0 and window["checkpoint"] == 2.0
    assert window["step"] == pytest.approx(6.0)  # (2 * 4 s + 4 s checkpoint) / 2 steps
    assert window["other"] == pytest.approx(0.5)
    assert timer.wall_s == pytest.approx(12.0)  # tokens/s: the window's wall time, evaluation left out
    with steps.section(Phase.DATA):
        clock[0] += 1.0
    assert timer.window()["step"] == 1.0  # the new window starts where the last ended


# --- MetricsLogger and its sinks ----------------------------------------------------------------


def test_metrics_logger_jsonl_records(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    logger = _logger(_cfg(), tmp_path, is_main=True, world_size=4, flops_per_token=1e6, progress_bar=False)
    logger.log_event("start", 0, config_hash="abc", checkpoint=tmp_path / "ckpt")
    logger.log_train(10, {"loss": torch.tensor(2.5), "lr": 1e-3, "grad_norm": 0.75, "time_step_s": 0.25})
    logger.log_train(20, {"loss": float("nan"), "lr": 1e-3, "grad_norm": 1.0}, tokens=2000, seconds=2.0)
    logger.log_eval(20, {"val_loss": 2.0})
    logger.close()

    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    again = _logger(_cfg(), tmp_path, is_main=True, world_size=4, flops_per_token=1e6, progress_bar=False)
    again.log_event("resume", 20)
    again.close()

    start, train, nan_train, ev, resume = _read_jsonl(tmp_path / "metrics.jsonl")
    assert start == {**start, "kind": "event", "event": "start", "step": 0, "job_id": "4242", "restart": 2}
    assert start["checkpoint"] == str(tmp_path / "ckpt")
    assert train["kind"] == "train" and train["step"] == 10 and train["loss"] == 2.5
    assert train["tokens_per_s"] == 16 * 128 / 0.25 == 8192.0
    assert train["tokens_per_s_per_device"] == 2048.0
    assert train["mfu"] == pytest.approx(2048.0 * 1e6 / 1e12)
    assert train["mem_peak_gib"] > 0 and isinstance(train["time"], float)
    assert nan_train["loss"] is None and nan_train["tokens_per_s_per_device"] == 250.0
    assert ev == {**ev, "kind": "eval", "step": 20, "val_loss": 2.0, "val_ppl": pytest.approx(math.exp(2.0))}
    assert resume["event"] == "resume" and resume["job_id"] is None and resume["restart"] == 0


def test_metrics_logger_tensorboard_and_non_main(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(_cfg(tensorboard=True), tmp_path, True, world_size=1, flops_per_token=1e6)
    for step, loss in ((10, 3.0), (20, 2.0)):
        logger.log_train(step, {"loss": loss, "lr": 1e-3, "grad_norm": 0.5, "time_step_s": 1.0})
    logger.log_eval(20, {"val_loss": 2.2})
    logger.log_event("checkpoint", 20, path="ckpt/step_20")
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/mfu", "eval/val_loss"} <= set(tags)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 3.0), (20, 2.0)]
    assert acc.Scalars("train/tokens_per_s")[0].value == 2048.0
    assert acc.Scalars("eval/val_loss")[0].value == pytest.approx(2.2)

    other = tmp_path / "rank1"
    worker = _logger(_cfg(tensorboard=True), other, is_main=False)
    worker.log_train(10, {"loss": 1.0, "lr": 1.0, "grad_norm": 1.0})
    worker.log_event("stop", 10)
    worker.close()
    assert not other.exists()


class _FakeWandbRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_sink_persists_and_reuses_run_id(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(_FakeWandbRun(kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _cfg(wandb=True, wandb_project="proj", wandb_mode="offline", jsonl=False)

    first = _logger(cfg, tmp_path, True, world_size=2, flops_per_token=1e6)
    first.log_train(5, {"loss": 1.5, "lr": 1e-3, "grad_norm": 0.1, "time_step_s": 2.0})
    first.log_eval(5, {"val_loss": 1.7})
    first.log_event("stop", 5)
    first.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert len(run_id) == 16
    second = _logger(cfg, tmp_path, True, world_size=2, flops_per_token=1e6)  # the requeued job
    second.close()

    assert [r.kwargs["id"] for r in runs] == [run_id, run_id]
    kwargs = runs[0].kwargs
    assert kwargs["resume"] == "allow" and kwargs["mode"] == "offline" and kwargs["project"] == "proj"
    assert kwargs["dir"] == str(tmp_path) and kwargs["config"]["train"]["seq_len"] == 128
    (step, train), (eval_step, evals) = runs[0].logged
    assert step == 5 and train["train/loss"] == 1.5 and train["train/tokens_per_s"] == 1024.0
    assert eval_step == 5 and evals["eval/val_loss"] == 1.7
    assert runs[0].finished and runs[1].finished


def test_wandb_missing_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match="pip install wandb"):
        _logger(_cfg(wandb=True, jsonl=False), tmp_path, True, flops_per_token=1e6)


def test_console_line_and_progress_bar(capsys):
    rec = {
        "loss": 2.34567, "lr": 3e-4, "grad_norm": 0.5,
        "tokens_per_s": 123456.0, "tokens_per_s_per_device": 15432.0, "mfu": 0.4123,
        "mem_allocated_gib": 30.2, "mem_reserved_gib": 34.0, "mem_peak_gib": 35.5,
        "time_step_s": 4.2, "time_data_s": 0.01, "time_forward_backward_s": 3.5, "time_optimizer_s": 0.4,
        "time_checkpoint_s": 0.0,
    }  # fmt: skip
    line = format_train_line(120, 1000, rec)
    assert line == (
        "step 120/1000 | loss 2.3457 | lr 3.00e-04 | grad 0.500 | 123.46k tok/s (15.43k/dev) | MFU 41.2% | "
        "mem 30.2/34.0 GiB (peak 35.5) | step 4.200s (data 0.010, fwd+bwd 3.500, opt 0.400, ckpt 0.000)"
    )
    assert "loss nan" in format_train_line(1, 10, {"loss": None, "lr": 1.0, "grad_norm": None})

    from rich.console import Console

    screen = io.StringIO()
    sink = ConsoleSink(total_steps=10, progress_bar=True, console=Console(file=screen, force_terminal=True))
    sink.write_line("step 5/10 | loss 1.0", step=5, summary="loss 1.0")
    sink.close()
    assert "5/10" in screen.getvalue()  # the bar was drawn
    sink = ConsoleSink(total_steps=10, progress_bar=False)
    sink.write_line("plain line", step=1)
    sink.close()


# --- rank logs ----------------------------------------------------------------------------------


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.captureWarnings(False)


def test_setup_logging_rank_files_and_console(tmp_path, capsys, restore_root_logger):
    log = logging.getLogger("relaytrain.test")
    plain = logging.StreamHandler(sys.stderr)  # what logging.basicConfig in a CLI installs
    logging.getLogger().addHandler(plain)
    path = setup_logging(RunDir(tmp_path), rank=3, local_rank=1, node="node2", rank_logs=True)
    assert path == tmp_path / "logs" / "rank_3.log"
    assert plain not in logging.getLogger().handlers
    log.info("info from rank 3")
    log.warning("warning from rank 3")
    out = capsys.readouterr()
    assert "info from rank 3" not in out.out + out.err
    assert "[rank 3 node2 local 1] WARNING relaytrain.test: warning from rank 3" in out.err

    setup_logging(
        RunDir(tmp_path), rank=0, local_rank=0, node="node1", rank_logs=True
    )  # replaces the handlers
    log.info("info from rank 0")
    out = capsys.readouterr()
    assert "[rank 0 node1 local 0] INFO relaytrain.test: info from rank 0" in out.out
    text3 = (tmp_path / "logs" / "rank_3.log").read_text()
    assert "info from rank 3" in text3 and "warning from rank 3" in text3 and "rank 0" not in text3
    line0 = (tmp_path / "logs" / "rank_0.log").read_text().strip()
    assert line0[:4].isdigit() and line0.endswith("info from rank 0")  # timestamp first

    assert setup_logging(RunDir(tmp_path / "nolog"), 1, 1, "n", rank_logs=False) is None
    assert not (tmp_path / "nolog").exists()


# --- profiler -----------------------------------------------------------------------------------


def _profile_cfg(window: list[int]) -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.metrics.profile_steps = window
    return cfg


def test_profiler_writes_trace_and_summary(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = StepProfiler(_profile_cfg([2, 4]).metrics, RunDir(tmp_path), rank=0, device=torch.device("cpu"))
    caplog.set_level(logging.INFO, logger="relaytrain.monitor.profiler")
    prof.step(0)  # before the loop: the job starts from step 0
    for step in range(1, 6):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        prof.step(step)
    prof.close()  # no-op: the window already closed itself
    trace = tmp_path / "profile" / "trace_rank0_steps2-4.json"
    assert prof.trace_path == trace
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert "aten::addmm" in names
    assert prof.summary["compute"] > 0 and prof.summary["communication"] == 0.0
    assert "profile of 2 steps" in caplog.text and "compute" in caplog.text

    with pytest.raises(UserError, match="profile_steps"):
        StepProfiler(_profile_cfg([5, 5]).metrics, RunDir(tmp_path), 0, torch.device("cpu"))
    idle = StepProfiler(_profile_cfg([]).metrics, RunDir(tmp_path / "idle"), 0, torch.device("cpu"))
    idle.step(1)
    idle.close()
    assert not (tmp_path / "idle").exists()


def test_profiler_counts_collectives_and_closes_early(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = torch.nn.Linear(16, 16)
        prof = StepProfiler(
            _profile_cfg([1, 10]).metrics, RunDir(tmp_path), rank=0, device=torch.device("cpu")
        )
        prof.step(0)
        for step in (1, 2):
            layer(torch.randn(4, 16)).sum().backward()
            dist.all_reduce(layer.weight.grad)
            prof.step(step)
        prof.close()  # the run stopped inside the window: what was captured is still written
        assert prof.trace_path == tmp_path / "profile" / "trace_rank0_steps1-10.json"
        assert prof.summary["communication"] > 0 and prof.summary["compute"] > 0
    finally:
        dist.destroy_process_group()


def test_classify_op_and_memory_snapshot_on_cpu(tmp_path, caplog):
    assert classify_op("c10d::allreduce_") == "communication"
    assert classify_op("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert classify_op("gloo:all_reduce") == "communication"
    assert classify_op("aten::mm") == "compute"
    assert classify_op("sm90_xmma_gemm_bf16bf16_bf16f32") == "compute"
    assert classify_op("ProfilerStep#3") == "other" and classify_op("aten::copy_") == "other"
    caplog.set_level(logging.INFO)
    assert record_memory_history(torch.device("cpu")) is False
    assert dump_memory_snapshot(torch.device("cpu"), tmp_path / "snap.pickle") is None
    assert "CUDA-only" in caplog.text and not (tmp_path / "snap.pickle").exists()


def test_cuda_memory_peak_is_per_window_with_retries_and_max_over_ranks(monkeypatch):
    """CUDA figures without a GPU: the allocator's counters are faked, the other rank's all-reduce too."""
    from relaytrain.monitor import memory as memory_mod

    gib, allocator = 1024**3, {"peak": 5.0, "retries": 0}
    cuda = memory_mod.torch.cuda
    monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: 1 * gib)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: 6 * gib)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: allocator["peak"] * gib)
    monkeypatch.setattr(cuda, "memory_stats", lambda d=None: {"num_alloc_retries": allocator["retries"]})
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: allocator.update(peak=1.0))
    device = torch.device("cuda")
    first = memory_mod.window_memory_stats(device)
    assert first["mem_peak_gib"] == 5.0 and first["mem_alloc_retries"] == 0
    allocator["retries"] = 3
    second = memory_mod.window_memory_stats(device)
    assert second["mem_peak_gib"] == 1.0, "the peak was not reset for the next log window"
    assert second["mem_alloc_retries"] == 3

    other_rank = {"mem_peak_gib": 9.0, "mem_alloc_retries": 1.0}  # the other rank's figures
    dist = memory_mod.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(
        memory_mod.torch, "tensor", lambda data, **kw: torch.as_tensor(data, dtype=kw["dtype"])
    )

    def all_reduce(t, op=None, group=None):
        keys = ["mem_allocated_gib", "mem_alloc_retries", "mem_peak_gib", "mem_reserved_gib"]
        theirs = torch.tensor([other_rank.get(k, 0.0) for k in keys], dtype=t.dtype)
        t.copy_(torch.maximum(t, theirs))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    stats = memory_mod.window_memory_stats(device)
    assert stats["mem_peak_gib"] == 9.0 and stats["mem_alloc_retries"] == 3  # each its own maximum
    line = format_train_line(1, 10, {"loss": 1.0, **stats})
    assert "peak 9.0" in line and "alloc retries 3" in line
