"""Generated configs and override lists: each is accepted, or refused with one `UserError` line that
names the key; nothing else escapes (issue 13 §4). The same holds through `relaytrain.cli.main`, and
for the checks that run before step 1 (the parallel layout and `relaytrain plan`'s arithmetic)."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import types
import typing

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaytrain.cli import main
from relaytrain.config import Config, load_config
from relaytrain.config.domains import domain_of
from relaytrain.errors import UserError
from relaytrain.parallel.layout import validate_layout
from relaytrain.plan.checks import make_plan

# A few seconds in the fast suite; RELAYTRAIN_FUZZ_EXAMPLES=2000 for a longer hunt. No example database:
# the tests leave nothing behind in the checkout.
FAST = settings(
    max_examples=int(os.environ.get("RELAYTRAIN_FUZZ_EXAMPLES", "150")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# (section, key, type, Domain or None) for every key of the schema.
FIELDS = [
    (section.name, f.name, typing.get_type_hints(section.default_factory)[f.name], domain_of(f))
    for section in dataclasses.fields(Config)
    for f in dataclasses.fields(section.default_factory)
]

# Text that reaches the config through argv: NUL, line breaks, undecodable bytes (argv carries them as
# lone surrogates), '%', '/', and the path names '.' and '..'.
TEXT = st.one_of(
    st.text(st.characters(codec=None, categories=None), max_size=12),
    st.sampled_from(["", ".", "..", "a/b", "%j", "x%", "a\x00b", "a\nb", "\udcff", "SIGKILL", "SIG_DFL"]),
    st.sampled_from(["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "run-1", "ok name", "é"]),
)
NUMBER = st.one_of(
    st.integers(-3, 300),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-12, 0.5, 1.0, 1e308, -1e308]),
)
SCALAR = st.one_of(NUMBER, TEXT, st.booleans())
VALUE = st.one_of(
    SCALAR,
    st.lists(st.one_of(NUMBER, TEXT), max_size=3),
    st.dictionaries(TEXT, st.one_of(NUMBER, TEXT), max_size=2),
)


def _toml_literal(value) -> str | None:
    """`value` as the right-hand side of `v = ...`, or None when TOML cannot carry it."""
    if isinstance(value, dict):
        items = [(_toml_literal(k), _toml_literal(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k} = {v}" for k, v in items) + "}"
    try:
        return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()
    except (TypeError, ValueError, UnicodeEncodeError):
        return None


def _override(section: str, key: str, value) -> str:
    literal = _toml_literal(value)
    return f"--{section}.{key}={literal if literal is not None else value}"


def _one_line(exc: UserError) -> str:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    text.encode("utf-8")  # printable on a UTF-8 terminal: undecodable bytes arrive escaped
    return text


def _load(overrides: list[str], path=None) -> Config | None:
    """load_config's result, or None after checking that the refusal is one UserError line."""
    try:
        return load_config(path, overrides)
    except UserError as exc:
        _one_line(exc)
        return None


def _type_allows(tp, value) -> bool:
    """Whether `value` has the type `tp` promises, for every type the schema uses: a union takes what any
    of its alternatives takes, a literal only its own values of their own type (`1` is not `True`), a
    float any finite number, a string printable text, a list its element type, a table printable
    strings and numbers (they become strings: `--slurm.env={N = 1}`)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_allows(alternative, value) for alternative in typing.get_args(tp))
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin is list:
        return isinstance(value, list) and all(_type_allows(typing.get_args(tp)[0], v) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(v, (str, int, float)) and k.isprintable() and str(v).isprintable()
            for k, v in value.items()
        )
    if tp is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if tp is int:
        return isinstance(value, int)
    if tp is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str) and value.isprintable()
    raise AssertionError(f"the oracle does not know the schema's type {tp!r}: teach _type_allows")


def _field_allows(tp, domain, value) -> bool:
    """The schema's own promise for one key: its type, then its domain (each element of a list, a
    table's values as the strings they become)."""
    if not _type_allows(tp, value):
        return False
    if domain is None:
        return True
    origin = typing.get_origin(tp)
    if origin is list:
        return (not domain.lengths or len(value) in domain.lengths) and all(domain.test(v) for v in value)
    if origin is dict:
        return domain.test({str(k): str(v) for k, v in value.items()})
    if origin is typing.Literal:
        return domain.test(value)
    return domain.test(float(value) if tp is float else value)


def _check_key(section: str, key: str, tp, domain, value) -> None:
    """`section.key = value` in a config file is accepted exactly when the oracle allows it (a refusal of
    an allowed value must name the key: it may clash with another key's default)."""
    # Set directly (no override parsing) so that the value reaching the checks is the generated one.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.toml")
        try:
            body = tomli_w.dumps({section: {key: value}})
        except (TypeError, ValueError):
            return  # not representable in TOML (e.g. a mixed-type list in old TOML writers)
        with open(path, "wb") as out:
            out.write(body.encode("utf-8", "surrogatepass"))
        try:
            load_config(path)
        except UserError as exc:
            message = _one_line(exc)
            if _field_allows(tp, domain, value):
                # Only another key's check may refuse it, naming this key; never this key's own type or
                # domain check (the oracle would then promise more than the schema keeps).
                assert f"{section}.{key}" in message, (value, message)
                own = (f"'{section}.{key}' expects", f"{section}.{key}={value!r} is not allowed")
                assert not any(text in message for text in own), (value, message)
            return
    assert _field_allows(tp, domain, value), f"{section}.{key}={value!r} was accepted"


@FAST
@given(st.sampled_from(FIELDS), VALUE)
def test_one_key_is_accepted_exactly_when_its_domain_allows_it(field, value):
    _check_key(*field, value)


def _probes(tp, default) -> list:
    """Values that sit on each side of a type's edges: every literal, each alternative of a union, the
    numbers around 0, wrong types, and the default."""
    values = [default, 0, 1, -1, 0.5, True, False, "auto", "x", "", [], {}, [1.0], ["a"], {"A": "1"}]
    for alternative in (
        typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    ):
        if typing.get_origin(alternative) is typing.Literal:
            values += list(typing.get_args(alternative))
    return values


@pytest.mark.parametrize("field", FIELDS, ids=[f"{s}.{k}" for s, k, _, _ in FIELDS])
def test_the_oracle_agrees_with_the_schema_on_every_key(field):
    """Every key of the schema, deterministically: the oracle of the property test above holds for its
    default, its literals, each alternative of its union and the usual wrong types, so a type the oracle
    misreads fails here, not by the draw."""
    section, key, tp, domain = field
    default = getattr(getattr(Config(), section), key)
    for value in _probes(tp, default):
        _check_key(section, key, tp, domain, value)


@FAST
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUE), max_size=4), st.lists(TEXT, max_size=2))
def test_override_lists_never_escape_as_another_exception(pairs, junk):
    overrides = [_override(section, key, value) for (section, key, _, _), value in pairs]
    overrides += [f"--{text}" if i % 2 else text for i, text in enumerate(junk)]
    _load(overrides)


@FAST
@given(st.binary(max_size=80) | st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_config_file_bytes_are_accepted_or_refused_in_one_line(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.toml")
        with open(path, "wb") as out:
            out.write(data)
        _load([], path)


def test_non_utf8_file_and_bytes_name_the_problem(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    assert "is not UTF-8 text" in _one_line(_expect_refusal([], path))
    assert "printable" in _one_line(_expect_refusal(["--run.name=a\udcffb"]))
    assert "printable" in _one_line(_expect_refusal(["--run.name=a\x00b"]))


def _expect_refusal(overrides, path=None) -> UserError:
    try:
        load_config(path, overrides)
    except UserError as exc:
        return exc
    raise AssertionError(f"accepted {overrides}")


INVALID = st.sampled_from(
    [
        "--model.multiple_of=0",
        "--model.ffn_dim_multiplier=nan",
        "--resilience.init_timeout_s=1e308",
        "--model.init_std=-0.02",
        "--resilience.signals=['SIGTERM','SIGUSR2','SIGKILL']",
        "--resilience.signals=['SIG_DFL']",
        "--optim.lr=inf",
        "--optim.eps=0",
        "--model.rope_theta=0",
        "--model.norm_eps=-1e-5",
        "--resilience.nan_rollback_lr_scale=-1",
        "--train.grad_clip=-0.5",
        "--run.name=..",
        "--run.name=.",
        "--run.name=a%jb",
        "--run.name=a\x00b",
        "--run.name=a\udcffb",
        "--run.name=a\nb",
        "--train.max_steps=abc",
        "--no.such=1",
        "stray",
    ]
)


@settings(max_examples=40, deadline=None, database=None)
@given(INVALID, st.sampled_from(["train", "plan", "launch"]))
def test_cli_refuses_in_one_stderr_line_with_exit_2(bad, command):
    import contextlib
    import io

    err = io.StringIO()
    args = [command] + (["configs/debug.toml"] if command != "train" else []) + [bad]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("relaytrain: error: "), (args, lines)


SHAPES = st.fixed_dictionaries(
    {
        "model.dim": st.sampled_from([0, 16, 48, 64, 96]),
        "model.n_heads": st.sampled_from([1, 2, 3, 4, 8]),
        "model.n_kv_heads": st.sampled_from([1, 2, 4]),
        "model.multiple_of": st.sampled_from([0, 1, 7, 64]),
        "model.ffn_dim_multiplier": st.sampled_from([0.0, 0.5, 1.3, float("inf")]),
        "train.global_batch_size": st.sampled_from([1, 4, 8, 12]),
        "train.micro_batch_size": st.sampled_from([1, 2, 4]),
        "parallel.tp": st.sampled_from([0, 1, 2, 4]),
        "parallel.pp": st.sampled_from([1, 2, 3]),
        "parallel.cp": st.sampled_from([1, 2]),
        "parallel.dp_shard": st.sampled_from([-1, 1, 2, 0]),
        "parallel.pp_schedule": st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
        "parallel.pp_virtual_stages": st.sampled_from([1, 2]),
    }
)


@FAST
@given(SHAPES, st.integers(1, 16), st.integers(1, 8), st.sampled_from(["", "h100", "a100-40gb", "nope"]))
def test_checks_before_step_one_raise_only_user_errors(shape, world_size, gpus_per_node, gpu):
    cfg = _load([_override(*key.split("."), value) for key, value in shape.items()])
    if cfg is None:
        return
    try:
        validate_layout(cfg.parallel, cfg.model, cfg.train, world_size, gpus_per_node, device_type="cpu")
    except UserError as exc:
        _one_line(exc)
    nodes = max(1, world_size // gpus_per_node)
    try:
        make_plan(cfg, nodes, gpus_per_node, gpu)
    except UserError as exc:
        _one_line(exc)


# Every numeric key, at the edges of what its domain lets through: `relaytrain plan`'s arithmetic (node
# ranges, batch splits, memory, step time, save and load times, time-limit suggestions) must hold for all
# of them, or the domain must refuse the value (a subnormal slurm.fs_write_gbps once overflowed).
NUMERIC = [(s, k, tp, d) for s, k, tp, d in FIELDS if tp in (int, float) and d is not None]
EDGES = [0, 1, -1, 2, 3, 7, 64, 2**20, 2**31, 2**53, 2**63 - 1, 5e-324, 1e-300, 1e-12, 1e-3, 0.5, 1e15, 1e300]
PLAN_LAYOUTS = [
    ("debug", ["--slurm.nodes=1", "--slurm.gpus_per_node=1"]),
    ("debug", ["--slurm.nodes=2", "--slurm.gpus_per_node=2", "--parallel.pp=2"]),
    ("debug", ["--slurm.nodes=1", "--slurm.gpus_per_node=0", "--slurm.tasks_per_node=2"]),
    ("70b", ["--slurm.nodes=4", "--slurm.gpus_per_node=8", "--checkpoint.snapshot_every=10"]),
]
# plan's arithmetic, not the data rule (tests/test_data_fit.py), which would refuse 70b and long runs first.
PLAN_LAYOUTS = [(preset, [*fixed, "--data.allow_small=true"]) for preset, fixed in PLAN_LAYOUTS]


def _edge_values(tp, domain) -> list:
    values = [tp(v) for v in EDGES if tp is float or isinstance(v, int)]
    return [v for v in values if domain.test(v)]


class _Slow(Exception):
    pass


def _plan(args: list[str]) -> tuple[int, str]:
    """`relaytrain plan ARGS` in this process, as on a login node whose Slurm is away: (exit, stderr)."""
    import contextlib
    import io
    import signal

    def slow(*_):
        raise _Slow(f"{args} ran over 60 s")

    previous = signal.signal(signal.SIGALRM, slow)
    signal.alarm(60)
    os.environ["SLURM_CONF"] = "/nonexistent/slurm.conf"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        del os.environ["SLURM_CONF"]
    return code, err.getvalue()


def _plan_args(section: str, key: str, value, layout: int) -> list[str]:
    preset, fixed = PLAN_LAYOUTS[layout]
    fixed = [f for f in fixed if not f.startswith(f"--{section}.{key}=")]
    return ["plan", f"configs/{preset}.toml", "--slurm.gpu_type=h100", *fixed, f"--{section}.{key}={value!r}"]


@settings(max_examples=int(os.environ.get("RELAYTRAIN_FUZZ_EXAMPLES", "40")), deadline=None, database=None)
@given(st.sampled_from(NUMERIC), st.integers(0, len(EDGES) - 1), st.integers(0, len(PLAN_LAYOUTS) - 1))
def test_plan_holds_for_every_numeric_key_at_its_domain_edges(field, index, layout):
    section, key, tp, domain = field
    edges = _edge_values(tp, domain)
    code, err = _plan(_plan_args(section, key, edges[index % len(edges)], layout))
    assert code in (0, 1) or (code == 2 and len(err.strip().splitlines()) == 1), err


@pytest.mark.parametrize(
    "section, key, value, layout",
    [
        ("slurm", "fs_write_gbps", 5e-324, 0),  # an OverflowError in the time-limit arithmetic
        ("metrics", "peak_flops", 5e-324, 0),  # a step time of infinity
        ("train", "global_batch_size", 2**62, 0),  # the batch split's divisor search ran for ever
        ("slurm", "nodes", 2**40, 3),  # plan walked every node count and every rank
    ],
)
def test_values_that_broke_plans_arithmetic_are_refused_in_one_line(section, key, value, layout):
    code, err = _plan(_plan_args(section, key, value, layout))
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{section}.{key}=" in err, err
