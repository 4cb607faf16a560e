"""The per-node GPU sampler with a fake NVML, the nvidia-smi dmon fallback, and no GPUs at all."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from relaytrain.monitor import gpu_monitor
from relaytrain.monitor.gpu_monitor import COLUMNS, GpuCsv, open_nvml, parse_dmon_line, sample_nvml

FAKE_PYNVML = textwrap.dedent(
    """
    from types import SimpleNamespace

    NVML_TEMPERATURE_GPU = 0


    class NVMLError(Exception):
        pass


    def nvmlInit():
        pass


    def nvmlShutdown():
        pass


    def nvmlDeviceGetCount():
        return 2


    HIDDEN = set()  # indexes whose handle NVML refuses (a GPU of another job's cgroup)


    def nvmlDeviceGetHandleByIndex(i):
        if i in HIDDEN:
            raise NVMLError("Insufficient Permissions")
        return i


    def nvmlDeviceGetUUID(h):
        return f"GPU-{h}a2b" if h else b"GPU-0a2b"  # older pynvml returns bytes


    def nvmlDeviceGetPciInfo(h):
        return SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0")


    def nvmlDeviceGetPowerUsage(h):  # milliwatts
        if h == 1:
            raise NVMLError("Not Supported")
        return 612500


    def nvmlDeviceGetUtilizationRates(h):
        return SimpleNamespace(gpu=97 - h, memory=41)


    def nvmlDeviceGetMemoryInfo(h):
        return SimpleNamespace(used=70 * 1024**3, total=80 * 1024**3)


    def nvmlDeviceGetTemperature(h, sensor):
        return 64 + h
    """
)

NO_NVML = "def nvmlInit():\n    raise RuntimeError('NVML Shared Library Not Found')\n"

DMON_OUTPUT = """\
# gpu    pwr  gtemp  mtemp     sm    mem    enc    dec    jpg    ofa   mclk   pclk     fb   bar1   ccpm
# Idx      W      C      C      %      %      %      %      %      %    MHz    MHz     MB     MB     MB
    0    350     61     55     93     40      0      0      0      0   2619   1980  71000     12      0
    1    341     59      -     90     38      0      0      0      0   2619   1980  70500     12      0
"""


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        return list(reader)


def _env(fake_dir: Path, **extra: str) -> dict[str, str]:
    src = Path(gpu_monitor.__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=f"{fake_dir}{os.pathsep}{src}", PATH=str(fake_dir), **extra)
    return env


def _run_until_samples(
    cmd: list[str], env: dict[str, str], csv_path: Path, rows: int
) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if csv_path.exists() and len(csv_path.read_text().splitlines()) > rows:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_nvml_sample_rows(tmp_path, monkeypatch):
    fake = types.ModuleType("pynvml")
    exec(FAKE_PYNVML, fake.__dict__)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node3")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    nvml, gpus, reason = open_nvml()
    assert nvml is fake and [g.handle for g in gpus] == [0, 1] and reason == ""
    out = GpuCsv(tmp_path / "gpu" / f"{gpu_monitor.host_name()}.csv")
    out.write(sample_nvml(nvml, gpus))
    out.close()
    rows = _read_csv(tmp_path / "gpu" / "gpu-node3.csv")
    assert [(r["host"], r["job_id"], r["gpu"], r["gpu_uuid"], r["pci_bus_id"]) for r in rows] == [
        ("gpu-node3", "777", "0", "GPU-0a2b", "00000000:18:00.0"),
        ("gpu-node3", "777", "1", "GPU-1a2b", "00000000:19:00.0"),
    ]
    first, second = rows
    assert first["power_w"] == "612.5" and second["power_w"] == ""  # unsupported reading: empty cell
    assert (first["util_gpu_pct"], second["util_gpu_pct"], first["util_mem_pct"]) == ("97", "96", "41")
    assert (first["mem_used_mib"], first["mem_total_mib"], second["temp_c"]) == ("71680.0", "81920.0", "65")
    assert float(first["time"]) > 1e9 and first["datetime"].startswith("20")


def test_monitor_process_stops_cleanly_on_sigterm_and_appends(tmp_path):
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    env = _env(tmp_path, SLURMD_NODENAME="node7", SLURM_JOB_ID="42")
    out_dir = tmp_path / "run" / "gpu"
    cmd = [
        sys.executable,
        "-m",
        "relaytrain.monitor.gpu_monitor",
        "--out",
        str(out_dir),
        "--interval",
        "0.05",
    ]
    csv_path = out_dir / "node7.csv"

    result = _run_until_samples(cmd, env, csv_path, rows=6)
    assert result.returncode == 0, result.stderr
    assert "sampling NVML, 2 GPUs" in result.stdout and not result.stderr
    rows = _read_csv(csv_path)
    assert len(rows) >= 6 and len(rows) % 2 == 0  # whole samples only: both GPUs of every sample
    assert {r["job_id"] for r in rows} == {"42"}

    env["SLURM_JOB_ID"] = "43"  # the requeued job appends to the same file, without a second header
    result = _run_until_samples(cmd, env, csv_path, rows=len(rows) + 2)
    assert result.returncode == 0, result.stderr
    again = _read_csv(csv_path)
    assert len(again) > len(rows) and {r["job_id"] for r in again} == {"42", "43"}


def test_no_gpu_writes_nothing_and_exits_zero(tmp_path):
    (tmp_path / "pynvml.py").write_text(NO_NVML)
    out_dir = tmp_path / "gpu"
    result = subprocess.run(
        [sys.executable, "-m", "relaytrain.monitor.gpu_monitor", "--out", str(out_dir), "--interval", "5"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert result.stdout.count("\n") == 1 and "no NVIDIA GPU" in result.stdout and not result.stderr
    assert not out_dir.exists()


def test_dmon_parsing():
    header, rows = None, []
    for line in DMON_OUTPUT.splitlines():
        header, row = parse_dmon_line(line, header)
        if row is not None:
            rows.append(row)
    assert rows == [
        {"gpu": "0", "power_w": "350", "temp_c": "61", "util_gpu_pct": "93", "util_mem_pct": "40",
         "mem_used_mib": "71000"},
        {"gpu": "1", "power_w": "341", "temp_c": "59", "util_gpu_pct": "90", "util_mem_pct": "38",
         "mem_used_mib": "70500"},
    ]  # fmt: skip
    assert parse_dmon_line("garbage line", header) == (header, None)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and executables")
def test_dmon_fallback_process(tmp_path):
    (tmp_path / "pynvml.py").write_text(NO_NVML)
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"header = {DMON_OUTPUT.splitlines()[:2]!r}\n"
        f"rows = {DMON_OUTPUT.splitlines()[2:]!r}\n"
        "if sys.argv[1].startswith('--query-gpu'):\n"
        "    print('0, GPU-aa, 00000000:18:00.0\\n1, GPU-bb, 00000000:19:00.0'); sys.exit()\n"
        "assert sys.argv[1:] == ['dmon', '-d', '1', '-s', 'pumt'], sys.argv\n"
        "print(*header, sep='\\n', flush=True)\n"
        "while True:\n"
        "    print(*rows, sep='\\n', flush=True)\n"
        "    time.sleep(0.05)\n"
    )
    fake_smi.chmod(0o755)
    out_dir = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "relaytrain.monitor.gpu_monitor", "--out", str(out_dir), "--interval", "1"]
    result = _run_until_samples(cmd, _env(tmp_path, SLURMD_NODENAME="node9"), out_dir / "node9.csv", rows=4)
    assert result.returncode == 0, result.stderr
    assert "nvidia-smi dmon" in result.stdout
    rows = _read_csv(out_dir / "node9.csv")
    assert len(rows) >= 4 and len(rows) % 2 == 0
    assert rows[0]["power_w"] == "350" and rows[1]["util_gpu_pct"] == "90" and rows[1]["mem_total_mib"] == ""
    assert (rows[1]["gpu"], rows[1]["gpu_uuid"], rows[1]["pci_bus_id"]) == ("1", "GPU-bb", "00000000:19:00.0")


def test_a_gpu_nvml_refuses_is_skipped_and_an_old_file_keeps_its_columns(tmp_path, monkeypatch):
    fake = types.ModuleType("pynvml")
    exec(FAKE_PYNVML, fake.__dict__)
    fake.HIDDEN.add(0)  # the job's cgroup hides GPU 0 from NVML
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml, gpus, reason = open_nvml()
    assert [(g.index, g.uuid) for g in gpus] == [(1, "GPU-1a2b")] and "GPU 0 skipped" in reason
    fake.HIDDEN.add(1)
    assert open_nvml()[1:] == (
        [],
        "GPU 0 skipped (Insufficient Permissions); GPU 1 skipped (Insufficient Permissions)",
    )
    old = ("time", "datetime", "host", "job_id", "gpu", "power_w")  # a file from before the id columns
    path = tmp_path / "node.csv"
    path.write_text(",".join(old) + "\n1.0,x,node,1,0,5.0\n")
    out = GpuCsv(path)
    out.write(sample_nvml(nvml, gpus))
    out.close()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[1]) == list(old) and rows[1]["gpu"] == "1" and rows[1]["power_w"] == ""
