"""Every entry of relaytrain.torch_private, called on the installed torch (2.13 where this was written;
pyproject.toml admits >=2.9,<2.14, whose other minors are not installed here), and the rule that nothing
else in src/ names a private torch module.

The entries run on a one-rank gloo group: what they read or patch is the same object a real world has.
"""

from __future__ import annotations

import ast
import inspect
import re
import types
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from relaytrain import torch_private as tp
from relaytrain.torch_private import agent as _agent  # noqa: F401 - tp.agent below
from relaytrain.torch_private import compiler as _compiler  # noqa: F401 - tp.compiler below

import needs

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        needs.skip_or_fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class _OpRecorder(tp.dispatch_mode_base()):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


# -- the production build and run -------------------------------------------------------------------


def test_flatten_mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = tp.flatten_mesh(mesh[("a", "b")], "ab")
    assert flat.mesh_dim_names == ("ab",) and flat.size() == 1


def test_saved_attention_ops_and_dispatch_mode_base():
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with _OpRecorder() as rec:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert set(rec.ops) & tp.saved_attention_ops(), f"none of {rec.ops} is a saved attention op"


@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*is deprecated:FutureWarning")
def test_functional_reduce_scatter_op(world):
    import torch.distributed._functional_collectives as funcol

    with _OpRecorder() as rec:
        funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, world).wait()
    assert tp.functional_reduce_scatter_op() in rec.ops


def test_group_timeout_process_groups_and_set_group_timeout(world):
    assert isinstance(tp.group_timeout(), timedelta)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=123))
    assert tp.group_timeout(group) == timedelta(seconds=123)
    assert group in tp.process_groups() and world in tp.process_groups()
    tp.set_group_timeout(group, timedelta(seconds=77))
    assert tp.group_timeout(group) == timedelta(seconds=77)


def test_resolve_process_group(world):
    assert tp.resolve_process_group(world.group_name) is world


def test_object_collective_device(world):
    assert tp.object_collective_device() == "cpu"


def test_cuda_memory_history_and_snapshot(tmp_path):
    if torch.cuda.is_available():
        tp.record_cuda_memory_history(True, 1000)
        torch.ones(1, device="cuda")
        tp.dump_cuda_memory_snapshot(tmp_path / "snap.pickle")
        tp.record_cuda_memory_history(False, 1000)
        assert (tmp_path / "snap.pickle").stat().st_size > 0
    else:  # a CPU build: the private functions exist and take the arguments passed
        inspect.signature(torch.cuda.memory._record_memory_history).bind(enabled=None, max_entries=1)
        inspect.signature(torch.cuda.memory._dump_snapshot).bind(str(tmp_path / "snap.pickle"))


def test_narrow_tensor_by_index():
    t = torch.arange(16).reshape(4, 4)
    assert torch.equal(tp.narrow_tensor_by_index(t, (1, 2), (2, 2)), t[1:3, 2:4])


def test_set_state_element():
    root = {"model": {"w": 1}}
    tp.set_state_element(root, ("model", "w"), 5)
    assert root == {"model": {"w": 5}}


def test_split_write_items_and_storage_info():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    planner = DefaultSavePlanner()
    state = {"a": torch.ones(64), "b": torch.ones(8), "c": torch.ones(32)}
    planner.set_up_planner(state, is_coordinator=True)
    items = planner.create_local_plan().items
    buckets = tp.split_write_items(2, items)
    assert len(buckets) == 2 and sorted(i.index.fqn for b in buckets for i in b) == ["a", "b", "c"]
    info = tp.storage_info("__0_0.distcp", 16, 256)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 16, 256)
    assert FileSystemWriter  # the writer whose metadata these records are


def test_bound_teardown_after_failure(monkeypatch):
    """The patched close waits `seconds` after a failure outside the agreed codes, torchrun's default
    after agreed ones, and what a caller passes. (tests/test_job_torchrun.py runs it in torchrun.)"""
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

    assert inspect.signature(PContext.close).parameters["timeout"].default == 30
    assert "_failures" in inspect.getsource(SubprocessContext._poll)
    waits = []
    monkeypatch.setattr(PContext, "close", lambda self, death_sig=None, timeout=30: waits.append(timeout))
    tp.agent.bound_teardown_after_failure(2, frozenset({75}))

    def context(*codes):
        return types.SimpleNamespace(
            _failures={i: types.SimpleNamespace(exitcode=c) for i, c in enumerate(codes)}
        )

    PContext.close(context(75, 3))
    PContext.close(context(75))
    PContext.close(context(-9), None, 7)
    assert waits == [2, 30, 7]


def test_replace_dead_workers(monkeypatch):
    """A dead worker is replaced alone with the extra variables (a dict), left to torchrun (None), or ends
    the restarts (False); a live one is left alone. Replacements are the policy's to count: torchrun's
    own restarts (its restart of every worker) stay as they were, 0 included. The replacement is the
    standby the policy started (it gets the rank's environment and output files, the worker its pid),
    else a new process; the agent's shutdown ends a standby, and none is started once the policy has no
    replacement left. (tests/test_survivors.py runs it in torchrun.)"""
    import os

    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import subprocess_handler

    wanted = {"entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options"}
    assert wanted <= set(inspect.signature(subprocess_handler.get_subprocess_handler).parameters)
    ns = types.SimpleNamespace
    started, shut = [], []
    healthy = ns(state=WorkerState.HEALTHY)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: healthy)
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, *a, **k: shut.append(self))
    monkeypatch.setattr(
        subprocess_handler, "get_subprocess_handler", lambda **kw: started.append(kw) or ns(proc=ns(pid=99))
    )

    class Standby:
        def __init__(self, command, env):
            self.command, self.env, self.proc, self.ready_after = (
                command,
                env,
                ns(pid=77, poll=lambda: None),
                1.0,
            )
            self.became, self.ended = None, False

        def ready(self):
            return True

        def become(self, env, stdout, stderr):
            self.became = (env, stdout, stderr)

        def end(self):
            self.ended = True

    class Policy:
        def __init__(self, answers, standby, left=1):
            self.answers, self.wants, self.standbys, self.told = iter(answers), standby, [], []
            self.left = left

        def replacements_left(self):
            return self.left

        def replacement_env(self, group, local_rank, code, env):
            return next(self.answers)

        def replaced(self, group, local_rank, pid, standby):
            self.told.append((local_rank, pid, standby))

        def standby(self, group, command, env):
            self.standbys += [Standby(command, env)] if self.wants else []
            return self.standbys[-1] if self.wants else None

        standby_ready = standby_exited = None

    def agent(code, restarts=0):
        handlers = {0: ns(proc=ns(poll=lambda: None)), 1: ns(proc=ns(poll=lambda: code))}
        context = ns(subprocess_handlers=handlers, entrypoint="python", args={0: ("-m", "x"), 1: ("-m", "x")},
                     envs={0: {"RANK": "0", "W": "2"}, 1: {"RANK": "1", "W": "2"}},
                     stdouts={1: "out1"}, stderrs={1: ""})  # fmt: skip
        return ns(_pcontext=context, _remaining_restarts=restarts), ns(workers=[ns(id=1), ns(id=2)])

    def poll(agent, group):
        assert LocalElasticAgent._monitor_workers(agent, group) is healthy
        handler = agent._pcontext.subprocess_handlers[1]
        return (
            agent._remaining_restarts,
            group.workers[1].id,
            handler.proc.pid if hasattr(handler.proc, "pid") else 0,
        )

    # A standby is started with the workers' command and what their environments share, then used.
    policy = Policy([{"EXTRA": "1"}], standby=True)
    tp.agent.replace_dead_workers(policy)
    live, group = agent(None)
    poll(live, group)
    (standby,) = policy.standbys
    assert standby.command == ["python", "-m", "x"] and standby.env == {**os.environ, "W": "2"}
    dead, group = agent(-9)  # torchrun's --max_restarts=0, as in a Slurm job step: replaced all the same
    dead._pcontext.relaytrain_standby = standby
    assert poll(dead, group) == (0, 77, 77) and policy.told[0] == (1, 77, standby)
    assert standby.became == ({**os.environ, "RANK": "1", "W": "2", "EXTRA": "1"}, "out1", "")
    assert not started and not standby.ended
    LocalElasticAgent._shutdown(dead)  # the next standby (started after the replacement) ends with it
    assert shut == [dead] and policy.standbys[-1] is not standby and policy.standbys[-1].ended

    # No standby: a new process; None: torchrun's; False: no restart of every worker either.
    policy = Policy([{"EXTRA": "1"}, None, False], standby=False)
    tp.agent.replace_dead_workers(policy)
    assert poll(*agent(-9, 2))[:2] == (2, 99) and started[0]["env"] == {"RANK": "1", "W": "2", "EXTRA": "1"}
    assert policy.told == [(1, 99, None)]
    assert poll(*agent(-9, 2))[0] == 2 and poll(*agent(-9, 2))[0] == 0 and len(started) == 1

    # No replacement left: the policy starts no standby, and the context's is ended.
    policy = Policy([], standby=True, left=0)
    tp.agent.replace_dead_workers(policy)
    live, group = agent(None)
    live._pcontext.relaytrain_standby = spare = Standby(["python"], {})
    poll(live, group)
    assert not policy.standbys and spare.ended


def test_optimizer_step_dtype():
    assert tp.optimizer_step_dtype(is_fused=True) == torch.float32
    assert tp.optimizer_step_dtype() == torch.get_default_dtype()


# -- the simulation --------------------------------------------------------------------------------


def test_fake_tensor_mode_and_fake_store():
    with tp.fake_tensor_mode():
        t = torch.empty(1 << 40, dtype=torch.uint8)  # a TiB: no data behind it
    assert type(t).__name__ == "FakeTensor" and t.shape == (1 << 40,)
    assert isinstance(tp.fake_store(), dist.Store)


def test_tree_leaves():
    assert tp.tree_leaves(([1, (2, 3)], {"a": 4})) == [1, 2, 3, 4]


def test_local_shape_and_offset():
    from torch.distributed.tensor import Shard

    shape, offset = tp.local_shape_and_offset(torch.Size((8, 4)), (2,), [1], (Shard(0),))
    assert (tuple(shape), tuple(offset)) == ((4, 4), (4, 0))


def test_shard_overlap():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    saved = Chunk(torch.Size((0, 0)), torch.Size((4, 4)))
    assert tp.shard_overlap(saved, Chunk(torch.Size((4, 0)), torch.Size((4, 4)))) is None
    regions = tp.shard_overlap(saved, Chunk(torch.Size((2, 0)), torch.Size((4, 4))))
    assert [length for *_, length in regions] == [2, 4]


def _schedule(world, declared: bool):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    x = torch.randn(2, 4)
    kwargs = {"input_args": (x,), "output_args": (torch.empty(2, 3),)} if declared else {}
    stage = PipelineStage(nn.Linear(4, 3), 0, 1, torch.device("cpu"), group=world, **kwargs)
    return ScheduleGPipe(stage, 2, loss_fn=lambda out, target: out.sum()), stage


def test_a_second_stage_works_exactly_when_the_stager_is_reusable():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.arange(4.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}
    stager.stage(state)
    reusable = tp.stager_reusable(stager)
    try:
        works = torch.equal(stager.stage(state)["w"], state["w"])
    except KeyError:  # torch 2.11: the dispatch table of a closed stager is empty
        works = False
    assert reusable == works


def test_the_simulation_names_what_this_torch_lacks_or_nothing(monkeypatch):
    from relaytrain.config import load_config
    from relaytrain.parallel import simulate as sim
    from relaytrain.parallel.layout import validate_layout

    gaps = tp.simulation_gaps()
    assert gaps == [] or all("_" in gap for gap in gaps)
    monkeypatch.setattr(tp, "simulation_gaps", lambda: ["ShardingPropagator._fake_mode_lock"])
    cfg = load_config(None, [])
    dims = validate_layout(cfg.parallel, cfg.model, cfg.train, 8, 8, "cuda")
    with pytest.raises(sim.SimulationError, match=r"lacks private names .*_fake_mode_lock.*torch 2.12-2.15"):
        sim.simulate(cfg, dims, 8)


OLD_TORCH = pytest.mark.skipif(
    bool(tp.simulation_gaps()),
    reason=f"torch {torch.__version__} lacks these names; plan --simulate refuses it in one line "
    "(test_the_simulation_names_what_this_torch_lacks_or_nothing)",
)


@OLD_TORCH
def test_pipeline_entries_settle_a_declared_schedule(world):
    from torch.distributed.pipelining._utils import InferenceMode

    schedule, stage = _schedule(world, declared=True)
    assert tp.schedule_stages(schedule) == [stage]
    inputs, outputs = tp.stage_declared_meta(stage)
    assert [t.shape for t in inputs] == [(2, 4)] and [t.shape for t in outputs] == [(2, 3)]
    assert not tp.stage_needs_inference(stage, schedule)
    assert tp.stage_needs_inference(_schedule(world, declared=False)[1], _schedule(world, False)[0])
    tp.validate_stage_at_runtime(stage)
    assert stage._runtime_validate is True
    tp.skip_warmup_vote(schedule)
    losses = []
    schedule.step(torch.randn(4, 4), target=torch.zeros(4, 3), losses=losses)
    assert len(losses) == 2 and stage._inference_mode == InferenceMode.STATIC


def test_trackers_and_their_hooks(world):
    from torch.distributed.fsdp import fully_shard

    mem_tracker, fsdp_tracker = tp.mem_tracker_classes()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    trackers = (mem_tracker(), fsdp_tracker(model, optimizer))
    for name, which in tp.TRACKER_HOOKS.items():
        assert callable(getattr(trackers[which], name, None)), f"{trackers[which]} has no hook {name}"
    for name, which in tp.TRACKER_ATTRIBUTES.items():
        assert hasattr(trackers[which], name), f"{trackers[which]} has no attribute {name}"
    group = tp.fsdp_param_group(model)
    assert group is not None and tp.partial_reduce_output(group) is None
    assert {"UNSHARDED_GRAD", "SHARDED_GRAD"} <= set(tp.fsdp_ref_type().__members__)


@OLD_TORCH
def test_sharding_propagation_lock():
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    before = ShardingPropagator._fake_mode_lock
    with tp.sharding_propagation_lock(lambda lock: ("wrapped", lock)):
        assert ShardingPropagator._fake_mode_lock == ("wrapped", before)
    assert ShardingPropagator._fake_mode_lock is before


# -- the rule ----------------------------------------------------------------------------------------


SEAM = {"tp": tp, "tp.agent": tp.agent, "tp.compiler": tp.compiler}  # the seam's modules, as named here


def entries(module) -> dict:
    return {
        n: f for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__
    }


def test_every_entry_has_a_test_here():
    # this file, and the compiler's hooks' in test_torch_private_compiler.py
    text = "".join(p.read_text() for p in sorted(Path(__file__).parent.glob("test_torch_private*.py")))
    names = [f"{alias}.{n}" for alias, module in SEAM.items() for n in entries(module)]
    names += ["tp.TRACKER_HOOKS", "tp.TRACKER_ATTRIBUTES"]
    untested = [n for n in names if not n.split(".")[-1].startswith("_") and n not in text]
    assert not untested, f"call these on the installed torch in this file: {untested}"


def test_every_entry_says_which_torch_it_was_checked_on():
    for module in SEAM.values():
        for name, f in entries(module).items():
            checked = re.search(r"Checked: 2\.\d+", f.__doc__ or "")
            assert checked, f"{name}: say which torch versions it was checked on"


# A private torch module or function named outside the seam: `torch._x`, `torch.a._b`, `c10d._x`.
_PRIVATE = re.compile(r"\btorch(?:\.\w+)*\._[a-z]\w*|\bc10d\._[a-z]\w*")


def private_torch_names(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            found += [node.module] if _PRIVATE.search(node.module) else []
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _PRIVATE.search(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            dotted = ast.unparse(node)
            found += [dotted] if _PRIVATE.fullmatch(dotted) or dotted.startswith("torch.ops._") else []
    return found


def test_no_private_torch_name_outside_the_seam():
    found = {
        str(p.relative_to(SRC)): names
        for p in SRC.rglob("*.py")
        if p.relative_to(SRC).parts[0] != "torch_private" and (names := private_torch_names(p.read_text()))
    }
    assert not found, f"put these behind relaytrain.torch_private: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "from torch._subclasses.fake_tensor import FakeTensorMode\n",
        "from torch.optim.optimizer import _get_scalar_dtype\n",
        "import torch.distributed._tools.mem_tracker\n",
        "torch.cuda.memory._dump_snapshot('x')\n",
        "c10d._get_default_group()\n",
        "torch.ops._c10d_functional.reduce_scatter_tensor\n",
    ],
)
def test_the_rule_sees_a_private_name(source):
    assert private_torch_names(source)


def test_compile_cache_counts_reads_inductor_s_graph_cache_counters():
    from torch._dynamo.utils import counters

    before = tp.compile_cache_counts()
    counters["inductor"]["fxgraph_cache_miss"] += 2
    counters["inductor"]["fxgraph_cache_bypass"] += 1
    counters["inductor"]["fxgraph_cache_hit"] += 4
    after = tp.compile_cache_counts()
    assert after == {"cold": before["cold"] + 3, "cached": before["cached"] + 4}
    for key, n in (("fxgraph_cache_miss", 2), ("fxgraph_cache_bypass", 1), ("fxgraph_cache_hit", 4)):
        counters["inductor"][key] -= n


def recording_collective() -> tuple[list[str], object]:
    """A stand-in for the progress board's `collective(name)`: records entering each and leaving."""
    import contextlib

    inside: list[str] = []

    @contextlib.contextmanager
    def collective(name):
        inside.append(name)
        yield
        inside.append("left")

    return inside, collective


def test_published_fsdp_comms_run_fsdps_own_calls_inside_the_named_collective(world):
    inside, collective = recording_collective()
    gather, scatter = tp.published_fsdp_comms(collective)
    out = torch.zeros(3)
    assert gather(output_tensor=out, input_tensor=torch.ones(3), group=world) is None
    scatter(output_tensor=out, input_tensor=torch.full((3,), 2.0), group=world, op=dist.ReduceOp.SUM)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert inside == ["fsdp_all_gather", "left", "fsdp_reduce_scatter", "left"]


def test_published_dtensor_redistributions_run_inside_the_named_collective_and_are_waited_for(world):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, _api, _dispatch, _redistribute, distribute_tensor

    inside, collective = recording_collective()

    original = _redistribute.redistribute_local_tensor
    tp.publish_dtensor_redistributions(collective)
    tp.publish_dtensor_redistributions(collective)  # once per process: not wrapped twice
    try:
        published = _redistribute.redistribute_local_tensor
        assert published is not original and _dispatch.redistribute_local_tensor is published
        assert _api.redistribute_local_tensor is published
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        y = x.redistribute(mesh, [Replicate()], async_op=True)  # as the parallel styles ask
        assert not isinstance(y._local_tensor, AsyncCollectiveTensor)
        assert torch.equal(y.to_local(), torch.arange(4.0))
        assert inside == ["dtensor_redistribute", "left"]
        same = published(x.to_local(), x._spec, x._spec)  # the same layout: no communication
        assert torch.equal(same, x.to_local()) and inside == ["dtensor_redistribute", "left"]  # unpublished
    finally:
        for module in (_redistribute, _dispatch, _api):
            module.redistribute_local_tensor = original


def test_published_dtensor_redistributions_wait_for_an_async_collective_inside_the_named_one(monkeypatch):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    events, collective = recording_collective()

    def issued(*_args, **_kwargs):  # as a parallel style's async redistribution returns
        return AsyncCollectiveTensor(torch.ones(2))

    for module in (_redistribute, _dispatch, _api):
        monkeypatch.setattr(module, "redistribute_local_tensor", issued, raising=False)
    monkeypatch.setattr(AsyncCollectiveTensor, "wait", lambda self: events.append("waited") or self.elem)
    tp.publish_dtensor_redistributions(collective)
    sharded, replicated = SimpleNamespace(placements=("S(0)",)), SimpleNamespace(placements=("R",))
    out = _dispatch.redistribute_local_tensor(torch.ones(2), sharded, replicated)
    assert events == ["dtensor_redistribute", "waited", "left"]
    assert not isinstance(out, AsyncCollectiveTensor) and torch.equal(out, torch.ones(2))
