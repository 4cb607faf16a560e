"""Layout validation: no processes, every bad layout is refused with a message that says what to change."""

from __future__ import annotations

import pytest

from relaytrain.config.schema import Config
from relaytrain.errors import UserError
from relaytrain.parallel.dims import ParallelDims
from relaytrain.parallel.layout import (
    batch_split_note,
    check_layout,
    resolve_dims,
    split_batch,
    validate_layout,
)


def make_cfg(**parallel) -> Config:
    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 256, 8, 8, 8
    cfg.model.vocab_size = 512
    cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_len = 32, 1, 128
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def validate(cfg: Config, world: int, gpn: int, device_type: str = "cuda") -> ParallelDims:
    return validate_layout(cfg.parallel, cfg.model, cfg.train, world, gpn, device_type)


def refused(cfg: Config, world: int, gpn: int, device: str = "cuda") -> str:
    with pytest.raises(UserError) as err:
        validate(cfg, world, gpn, device)
    return str(err.value)


def test_seed_000_tp8_over_two_nodes_of_four_is_refused_with_a_fix():
    msg = refused(make_cfg(tp=8), world=16, gpn=4)
    assert "node 0" in msg and "node 1" in msg and "tp=8" in msg
    assert "parallel.tp=4" in msg  # the proposed layout keeps tp inside a node of 4


def test_rank_order_that_strides_tp_across_nodes_is_refused():
    # Seed 000's symptom: a rank order that spreads tensor-parallel ranks over nodes.
    cfg = make_cfg(tp=4, pp=2, rank_order="pp,tp,cp,dp")
    msg = refused(cfg, world=16, gpn=4)
    assert "rank_order" in msg and "node 0" in msg and "node 1" in msg
    assert "rank_order='tp,cp,pp,dp'" in msg


def test_tp_must_be_inside_dp_and_cp_in_the_mesh():
    msg = refused(make_cfg(tp=2, rank_order="dp,tp,cp,pp"), world=4, gpn=4)
    assert "list tp before dp and cp" in msg
    msg = refused(make_cfg(cp=2, dp_replicate=2, rank_order="tp,dp,cp,pp"), world=4, gpn=4)
    assert "list cp before dp" in msg
    assert validate(make_cfg(tp=2, rank_order="tp,dp,cp,pp"), 4, 4).dp == 2


def test_seed_000_fixed_layouts_are_accepted():
    dims = validate(make_cfg(tp=8), 16, 8)
    assert (dims.tp, dims.dp_shard, dims.dp) == (8, 2, 2)
    assert dims.group_of(8, "tp") == list(range(8, 16))
    assert dims.group_of(3, "dp_shard") == [3, 11]
    dims = validate(make_cfg(tp=4), 16, 4)
    assert dims.dp == 4


def test_each_ranks_pipeline_stage_is_its_pp_coordinate():
    """The straggler watch's peers: with tp inside pp, ranks 0-1 and 4-5 are stage 0, 2-3 and 6-7 stage 1."""
    dims = ParallelDims(1, 2, 1, 2, 2, 8)
    assert dims.pipeline_stages() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert all(dims.pipeline_stages()[r] == dims.coordinates(r)["pp"] for r in range(8))
    assert ParallelDims(1, 4, 1, 1, 1, 4).pipeline_stages() == [0, 0, 0, 0]


def test_tp_that_does_not_divide_the_node_is_refused():
    assert "does not divide" in refused(make_cfg(tp=4), world=12, gpn=6)


def test_cp_group_must_stay_in_a_node():
    msg = refused(make_cfg(cp=2, rank_order="dp,tp,pp,cp"), world=8, gpn=4)
    assert "context-parallel" in msg


def test_hsdp_dims_and_mesh_order():
    dims = validate(make_cfg(dp_replicate=2, tp=2), 8, 4)
    assert dims == ParallelDims(2, 2, 1, 2, 1, 8, micro_batch_size=1, grad_accum=8)
    assert [name for name, _ in dims.mesh_dims] == ["dp_replicate", "dp_shard", "pp", "cp", "tp"]
    # HSDP: the replicate groups go across nodes, shard groups stay inside one.
    assert dims.group_of(0, "dp_replicate") == [0, 4]
    assert dims.group_of(0, "dp_shard") == [0, 2]


@pytest.mark.parametrize(
    "parallel, world, fragment",
    [
        ({"tp": 3}, 3, "must divide model.n_heads"),
        ({"tp": 2, "dp_shard": 3}, 4, "dp_shard=-1"),
        ({"tp": 3, "dp_shard": -1}, 4, "not divisible"),
        (
            {"pp": 4, "pp_virtual_stages": 4, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4},
            4,
            "fewer than",
        ),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, 2, "pp_virtual_stages >= 2"),
        ({"pp": 2, "pp_virtual_stages": 2}, 2, "one stage per rank"),
        ({"pp": 2, "pp_microbatches": 1}, 2, ">= parallel.pp"),
        (
            {"pp": 2, "pp_microbatches": 3, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
            2,
            "multiple of",
        ),
        ({"pp_virtual_stages": 2}, 2, "needs parallel.pp > 1"),
        ({"pp_microbatches": 4}, 2, "needs parallel.pp > 1"),
        ({"rank_order": "tp,dp"}, 2, "rank_order"),
        ({"cpu_offload": True}, 1, "more than one process"),
    ],
)
def test_bad_layouts_are_refused(parallel, world, fragment):
    assert fragment in refused(make_cfg(**parallel), world, max(world, 1))


def test_vocab_heads_ffn_seq_and_tied_embeddings_with_tp():
    cfg = make_cfg(tp=2)
    cfg.model.vocab_size = 511
    assert "round it up to 512" in refused(cfg, 2, 2)
    cfg = make_cfg(tp=4)
    cfg.model.n_kv_heads = 2
    assert "n_kv_heads=2" in refused(cfg, 4, 4)
    cfg = make_cfg(tp=2)
    cfg.train.seq_len = 127
    cfg.model.max_seq_len = 256
    assert "seq_len" in refused(cfg, 2, 2)
    cfg = make_cfg(tp=2)
    cfg.model.tie_embeddings = True
    assert "tie_embeddings" in refused(cfg, 2, 2)
    cfg = make_cfg(tp=2)
    cfg.model.ffn_dim = 333
    assert "feed-forward" in refused(cfg, 2, 2)


def test_batch_must_divide_by_dp_and_pipeline_microbatches():
    cfg = make_cfg()
    cfg.train.global_batch_size = 14
    msg = refused(cfg, 4, 4)
    assert "global_batch_size=14 must be divisible by the data-parallel degree 4" in msg
    assert "use global_batch_size=12 or 16" in msg
    cfg = make_cfg(pp=2, pp_microbatches=4)
    cfg.train.global_batch_size = 12
    assert "pp_microbatches=4" in refused(cfg, 4, 4)
    cfg.train.global_batch_size = 16
    dims = validate(cfg, 4, 4)
    assert (dims.dp, dims.micro_batch_size, dims.grad_accum) == (2, 2, 4)


@pytest.mark.parametrize(
    ("global_batch", "micro", "world", "split"),
    [
        (16, 4, 1, (4, 4)),  # divides: the configured micro batch
        (16, 4, 4, (4, 1)),
        (16, 8, 4, (4, 1)),  # debug.toml's old 16/8 on 4 ranks: 4 sequences a rank, one micro batch
        (16, 8, 2, (8, 1)),
        (12, 8, 2, (6, 1)),  # largest divisor of 6 that is <= 8
        (24, 4, 2, (4, 3)),
        (36, 8, 4, (3, 3)),  # 9 a rank: 8 does not divide, 3 does
        (14, 4, 2, (1, 7)),  # 7 a rank is prime: micro batch 1
    ],
)
def test_micro_batch_adapts_to_the_local_batch(global_batch, micro, world, split):
    cfg = make_cfg()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = global_batch, micro
    dims = validate(cfg, world, world)
    assert (dims.micro_batch_size, dims.grad_accum) == split
    assert dims.micro_batch_size * dims.grad_accum * dims.dp == global_batch
    note = batch_split_note(cfg.train, dims)
    if split[0] == micro:
        assert note is None
    else:
        assert f"train.micro_batch_size={micro} does not divide" in note
        assert f"using micro batch {split[0]} with {split[1]} accumulation steps" in note


def test_cp_refused_on_cpu_with_a_clear_message():
    msg = refused(make_cfg(cp=2), 2, 2, device="cpu")
    assert "needs CUDA" in msg and "parallel.cp=1" in msg
    assert validate(make_cfg(cp=2), 2, 2, device_type="cuda").cp == 2


def test_validate_layout_is_resolve_then_check_then_split():
    cfg = make_cfg(pp=2, pp_microbatches=4)
    dims = resolve_dims(cfg.parallel, 8)
    assert (
        check_layout(cfg.parallel, cfg.model, cfg.train, dims, 4, "cuda") is None
        and dims.micro_batch_size == dims.grad_accum == 0
    )
    split = split_batch(cfg.parallel, cfg.train, dims)
    assert (split.micro_batch_size, split.grad_accum, split.local_batch_size) == (2, 4, 8)
    assert split == validate(cfg, 8, 4) and split.local_batch_size * split.dp == 32
    cfg.train.global_batch_size = 12
    with pytest.raises(UserError, match="data-parallel degree 4 x parallel.pp_microbatches=4"):
        check_layout(cfg.parallel, cfg.model, cfg.train, dims, 4, "cuda")


def test_resolve_dims_fills_dp_shard():
    cfg = make_cfg(tp=2, pp=2)
    dims = resolve_dims(cfg.parallel, 8)
    assert (dims.dp_shard, dims.dp, dims.world_size) == (2, 2, 8)
    assert dims.coordinates(5) == {"dp_replicate": 0, "dp_shard": 1, "pp": 0, "cp": 0, "tp": 1}


@pytest.mark.slow
def test_embedded_debug_config_trains_on_four_ranks_and_adapts_the_old_micro_batch(tmp_path):
    """`relaytrain train` with no config on 4 ranks; micro 8 (the old debug.toml) must adapt, not refuse.

    One run: the embedded config's own micro batch (4) is what micro 8 adapts to on 4 ranks (16 / 4 = 4
    sequences a rank, one micro batch), so this run trains exactly what the embedded config trains there.
    That a micro batch that divides prints no line is checked by test_micro_batch_adapts_to_the_local_batch
    and on 4 ranks by tests/test_doc_torchrun.py's parallelism lines (the embedded config as it is)."""
    from conftest import read_metrics, run_torchrun

    args = ["train", "--train.max_steps=3", "--train.eval_every=0", f"--run.dir={tmp_path}"]
    result = run_torchrun(4, [*args, "--train.micro_batch_size=8"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(tmp_path / "debug")[-1]["step"] == 3
    out = result.stdout + result.stderr
    adapted = "train.micro_batch_size=8 does not divide the 4 sequences per data-parallel rank"
    assert out.count(adapted) == 1, "one info line, from rank 0 only"
    assert "using micro batch 4 with 1 accumulation steps" in out, out[-3000:]
