"""The GPU benchmarks keep every run's results under bench/results/ (device, versions, every figure) and
render their sections from them: `--page-from` rewrites a section byte for byte, on any machine."""

from __future__ import annotations

import json

import pytest

from bench import gpu_first_hour, gpu_mfu, kept, torchtitan_gpu
from bench.report import REWRITTEN, section_body

MFU = {
    "ran": True, "command": "python -m bench.gpu_mfu --steps 20", "date": "2026-12-01 10:00 UTC",
    "gpu": "NVIDIA H100 80GB HBM3", "bf16_peak_flops": 7.92e14,
    "runs": [{"compile": False, "step_s": 0.759, "tokens_per_s": 43409.0, "trainer_mfu": 0.396,
              "measured_peak_mfu": 0.495, "first_step_s": 1.34, "mem_peak_gib": 47.1,
              "command": "relaytrain train"}],
}  # fmt: skip
TITAN = {
    "ran": True, "date": "2026-12-01 10:00 UTC", "shape": "debug", "why": "launch-bound: overheads, not MFU",
    "command": "python -m bench.torchtitan_gpu --shape debug --gpus 1 --pairs 1 --steps 30 --warmup 5 "
               "--seq 2048 --batch 8",
    "gpu": "1 x NVIDIA H100 80GB HBM3", "params": {"relaytrain": 6_000_000, "torchtitan": 6_000_000},
    "runs": [{"side": "torchtitan", "order": 0, "command": "torchrun ... torchtitan.train", "tps": 759.0,
              "mfu": 0.01},
             {"side": "relaytrain", "order": 1, "command": "torchrun ... relaytrain.cli train", "tps": 1943.0,
              "mfu": 0.03}],
    "ratio": 2.56,
}  # fmt: skip
FIRST_HOUR = {
    "date": "2026-12-01 10:00 UTC", "device": "NVIDIA H100 80GB HBM3",
    "versions": {"torch": "2.11.0+cu130", "cuda": "13.0"},
    "steps": {"snapshot": {"ok": True, "figures": {"blocking_ms": 12.5, "step_ms": 400.0}, "seconds": 70.0}},
}  # fmt: skip


@pytest.mark.parametrize(
    ("module", "prefix", "section", "result"),
    [
        (gpu_mfu, "gpu-mfu", "gpu", MFU),
        (gpu_first_hour, "gpu-first-hour", "gpu-first-hour", FIRST_HOUR),
        (torchtitan_gpu, "torchtitan", "torchtitan", TITAN),
    ],
)
def test_a_gpu_run_is_kept_and_its_section_rewritten_from_the_kept_file(
    module, prefix, section, result, tmp_path, monkeypatch
):
    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path / "results")
    saved = kept.keep_gpu_run(prefix, result)
    data = json.loads(kept.path_of(saved["kept"]).read_text())
    assert data["versions"]["torch"] and "cuda" in data["versions"] and "kept" not in data
    assert {k: v for k, v in data.items() if k != "versions"} == {
        k: v for k, v in result.items() if k != "versions"
    }
    text = module.render(saved)
    (command,) = [m.group("command") for m in REWRITTEN.finditer(text)]
    assert command == f"python -m {module.MODULE} --page-from {saved['kept']}"

    page = tmp_path / "benchmarks.md"
    page.write_text(f"# B\n\n<!-- bench:{section} -->\nold 1\n<!-- /bench:{section} -->\n")
    monkeypatch.setenv("BENCH_PAGE", str(page))
    assert module.main(["--page-from", saved["kept"]]) in (0, None)
    assert section_body(page.read_text(), section) == text.rstrip() + "\n"
    assert "12.5" in text or "759" in text  # the figures come from the kept file
