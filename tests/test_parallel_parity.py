"""Every layout reproduces the one-process run: losses, grad norms and eval loss of the first 3 steps.

The tiny model (dim 64, 4 layers, 4 heads, 2 KV heads, vocab 256, seq 32, global batch 8) is initialised
identically in every layout (per-name seeded init, sharding-invariant), trained with AdamW lr 1e-2 and
grad clipping at 1.0 on the same global batches. fp32 layouts are compared with the one-process fp32 run:
losses and eval loss within 2e-5 absolute (observed <= 1e-6: only the reduction order differs), grad
norms within 1e-4 relative (AdamW amplifies reduction-order noise in the weights by step 3).

bf16 rounds differently on every CPU instruction set: by step 3 the autocast grad norm is 2 % from the
fp32 run on AVX-512 and 11 % on AVX2, so no tolerance against fp32 holds everywhere. A bf16 layout is
therefore compared with a textbook bf16 run of the same scheme computed on the same CPU
(`mixed_precision_reference`): within 5e-3 absolute in loss and 1e-2 relative in grad norm (observed
<= 7e-4 and 1.4e-3 on AVX-512 and AVX2; a 1-ulp bf16 flip in a weight is 0.4 %), and at step 0, before
any update, within 1e-5 relative (observed 2e-7: the same bf16 products, only fp32 sums differ; a
gradient reduced in bf16 moves it 4e-5). It must also keep fp32
master weights, differ from the fp32 run (bf16 is really used), and stay within 1e-2 of it at step 0,
before AdamW amplifies anything (observed 2e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_cases import BENCH_ONLY, CASES, LAYOUTS, mixed_precision_reference, run_case  # noqa: E402

WORKER = Path(__file__).parent / "parallel_cases.py"
N2_CASES = [case for case in LAYOUTS[2] if case not in BENCH_ONLY]
N4_CASES = [case for case in LAYOUTS[4] if case not in BENCH_ONLY]
# bf16 case -> the textbook scheme it must reproduce (see mixed_precision_reference).
BF16_SCHEMES = {"fsdp_bf16": "cast_params", "autocast_bf16": "autocast"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Like each torchrun rank: on a shared 2-core box, 2 OpenMP threads can be 10x slower than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(one_thread) -> dict:
    return run_case("single", world_size=1, rank=0, gpus_per_node=1)


@pytest.fixture(scope="module")
def bf16_references(one_thread) -> dict[str, dict]:
    return {scheme: mixed_precision_reference(scheme) for scheme in sorted(set(BF16_SCHEMES.values()))}


def assert_close(result: dict, expected: dict, loss_abs: float, norm_rel: float) -> None:
    case = result["case"]
    assert result["losses"] == pytest.approx(expected["losses"], abs=loss_abs), case
    assert result["eval_loss"] == pytest.approx(expected["eval_loss"], abs=loss_abs), case
    assert result["grad_norms"] == pytest.approx(expected["grad_norms"], rel=norm_rel), case


def assert_matches(result: dict, reference: dict, bf16_references: dict[str, dict]) -> None:
    case = result["case"]
    assert result["master_dtypes"] == ["torch.float32"], f"{case}: the optimizer must update fp32 weights"
    if case not in BF16_SCHEMES:
        assert_close(result, reference, loss_abs=2e-5, norm_rel=1e-4)
        return
    expected = bf16_references[BF16_SCHEMES[case]]
    assert_close(result, expected, loss_abs=5e-3, norm_rel=1e-2)
    # Before the first update both runs multiply the same bf16 numbers: only fp32 sums differ.
    assert result["losses"][0] == pytest.approx(expected["losses"][0], rel=1e-5), case
    assert result["grad_norms"][0] == pytest.approx(expected["grad_norms"][0], rel=1e-5), case
    assert result["losses"] != reference["losses"], f"{case}: identical to fp32, bf16 was not used"
    assert result["losses"][0] == pytest.approx(reference["losses"][0], abs=1e-2), case
    assert result["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=1e-2), case


def launch(nproc: int, cases: list[str], tmp_path: Path) -> dict[str, dict]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PARALLEL_CASES_COMPILE_BACKEND="aot_eager",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    proc = subprocess.run(
        ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(WORKER), *cases],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["case"]] = result
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(results) == sorted(cases)
    return results


@pytest.mark.parametrize("case", [case for case in LAYOUTS[1] if case != "single"])
def test_single_process_features_match_reference(case, reference, bf16_references):
    assert_matches(run_case(case, world_size=1, rank=0, gpus_per_node=1), reference, bf16_references)


@pytest.mark.slow
def test_two_process_layouts_match_single_process(reference, bf16_references, tmp_path):
    results = launch(2, N2_CASES, tmp_path)
    for case in N2_CASES:
        assert_matches(results[case], reference, bf16_references)


@pytest.mark.slow
def test_four_process_layouts_match_single_process_and_pipelines_evaluate_on_the_pp_group(
    reference, bf16_references, tmp_path
):
    """Besides parity: a pipeline's evaluation sends stage to stage on the pp group (the default group
    would cost NCCL another communicator, with the default group's timeout). Four ranks: with two, the
    mesh's pp group spans the world and is the default group itself; here the pipelines run beside data
    or tensor parallelism (pp_fsdp_pp_outer_order, pp_tp_interleaved), and a layout without one sends
    nothing."""
    results = launch(4, N4_CASES, tmp_path)
    pipelines = [case for case in N4_CASES if CASES[case][0].get("pp", 1) > 1]
    assert len(pipelines) >= 2, N4_CASES
    for case in N4_CASES:
        assert_matches(results[case], reference, bf16_references)
        assert results[case]["eval_p2p_groups"] == (["pp"] if case in pipelines else []), case
