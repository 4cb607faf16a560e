"""Each config field's domain (range, finiteness, allowed names), declared beside the field in schema.py.

`setting(default, domain)` attaches a Domain to a dataclass field; `check_domains(cfg)` enforces every
field's domain plus the rules that hold for all fields: floats are finite, strings are printable
(no NUL, control characters or undecodable bytes). Checks that relate two fields live in validate.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from collections.abc import Callable
from typing import Any

from relaytrain.errors import ConfigError

# Longer timeouts and intervals than this are typos; their sum with a clock would overflow sleeps.
MAX_SECONDS = 10_000_000.0  # ~115 days
# More sequences per step than this are typos (Llama 3 405B: 16M tokens, 2K sequences); the batch split's
# divisor search stays cheap below it.
MAX_BATCH = 2**24
# Node counts and processes per node beyond any machine (the largest have ~10,000 nodes of 4-8 GPUs);
# plan's layout checks walk every rank.
MAX_NODES = 100_000
MAX_PER_NODE = 1024
MAX_NAME_BYTES = 200  # stays inside the 255-byte file-name limit with room for suffixes
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Domain:
    """What values a field accepts: `test` for each value (each element of a list), `text` for people."""

    text: str
    test: Callable[[Any], bool]
    lengths: tuple[int, ...] = ()  # lists: the allowed lengths (empty: any)

    def describe(self) -> str:
        if not self.lengths:
            return self.text
        counts = " or ".join(str(n) for n in self.lengths)
        return f"{counts} values, each {self.text}"


def setting(default: Any = dataclasses.MISSING, domain: Domain | None = None, *, factory=None) -> Any:
    """A dataclass field with its domain; `factory` for lists and tables."""
    metadata = {"domain": domain} if domain is not None else {}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _num(fmt: float) -> str:
    return f"{fmt:g}"


def at_least(lo: float) -> Domain:
    return Domain(f">= {_num(lo)}", lambda v: v >= lo)


def positive() -> Domain:
    return Domain("> 0", lambda v: v > 0)


def in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Domain:
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"

    def test(v: float) -> bool:
        above = v > lo if lo_open else v >= lo
        below = v < hi if hi_open else v <= hi
        return above and below

    return Domain(f"in {left}{_num(lo)}, {_num(hi)}{right}", test)


def zero_or_in_range(lo: float, hi: float) -> Domain:
    """0 (off, or: find it out) or a value in [lo, hi]."""
    return Domain(f"0 or in [{_num(lo)}, {_num(hi)}]", lambda v: v == 0 or lo <= v <= hi)


def zero_or_more_or(name: str) -> Domain:
    """An int >= 0, or the one name `name` (a mode beside the numbers, like "auto")."""
    return Domain(f">= 0 or {name!r}", lambda v: v == name if isinstance(v, str) else v >= 0)


def seconds(*, zero_ok: bool = True) -> Domain:
    """A duration: 0 (when it means off) up to MAX_SECONDS."""
    return in_range(0, MAX_SECONDS, lo_open=not zero_ok)


def minus_one_or_at_least(lo: int) -> Domain:
    return Domain(f"-1 or >= {lo}", lambda v: v == -1 or v >= lo)


def with_lengths(domain: Domain, *lengths: int) -> Domain:
    return dataclasses.replace(domain, lengths=lengths)


def catchable_signal() -> Domain:
    """A signal a process can handle: SIGKILL and SIGSTOP cannot be caught, SIG_DFL is not a signal."""
    names = set(signal.Signals.__members__) - {"SIGKILL", "SIGSTOP"}
    return Domain("a catchable signal name such as 'SIGTERM' (not SIGKILL or SIGSTOP)", lambda v: v in names)


def one_of(names: tuple[str, ...], what: str) -> Domain:
    """One of a fixed set of names (an alert's event, ...)."""
    return Domain(f"{what}: {', '.join(repr(n) for n in names)}", lambda v: v in names)


def env_name() -> Domain:
    """The name of an environment variable ('' for none)."""
    return Domain(
        "'' or an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
        lambda v: not v or bool(_ENV_NAME.fullmatch(v)),
    )


def slurm_time_seconds(text: str) -> int | None:
    """Seconds of a Slurm time limit (sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for no
    limit (empty: the partition's default; 0, UNLIMITED, INFINITE). ValueError for anything else."""
    if text.upper() in ("", "UNLIMITED", "INFINITE"):
        return None
    days, dash, rest = text.partition("-")
    if not dash:
        days, rest = "0", text
    parts = rest.split(":")
    if not all(p.isdigit() for p in (days, *parts)) or len(parts) > 3 or (dash and not parts[0]):
        raise ValueError(f"{text!r} is not a Slurm time")
    numbers = [int(p) for p in parts]
    if dash:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (numbers + [0, 0])[:3]
    elif len(numbers) == 3:  # H:M:S
        h, m, sec = numbers
    else:  # M, M:S
        h, m, sec = 0, numbers[0], (numbers[1] if len(numbers) == 2 else 0)
    total = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    return total or None


def slurm_time() -> Domain:
    def test(v: str) -> bool:
        try:
            slurm_time_seconds(v)
        except ValueError:
            return False
        return True

    return Domain(
        "a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S ('' for the partition's default, 0 or "
        "UNLIMITED for none)",
        test,
    )


def path_name() -> Domain:
    """One directory-name component that also reaches sbatch's `--output` pattern."""

    def test(v: str) -> bool:
        return (
            v.strip() != ""
            and v not in (".", "..")
            and "/" not in v
            and "%" not in v
            and len(v.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        )

    return Domain(
        f"a directory name: non-empty, not '.' or '..', no '/' or '%', <= {MAX_NAME_BYTES} bytes", test
    )


def path_without_percent() -> Domain:
    return Domain(
        "a non-empty path without '%' (sbatch reads '%' as a pattern)", lambda v: v != "" and "%" not in v
    )


def absolute_path() -> Domain:
    return Domain("an absolute path (it names the same folder on every node)", lambda v: v.startswith("/"))


def env_table() -> Domain:
    return Domain(
        "a table whose keys are environment variable names ([A-Za-z_][A-Za-z0-9_]*)",
        lambda v: all(_ENV_NAME.fullmatch(k) for k in v),
    )


def _printable(value: str) -> bool:
    return value.isprintable()  # excludes NUL, line breaks, other controls and lone surrogates


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} is not allowed: floats must be finite")
    if isinstance(value, str) and not _printable(value):
        raise ConfigError(
            f"{key}={value!r} is not allowed: text must be printable UTF-8 without NUL or line breaks"
        )


def _check_field(key: str, value: Any, domain: Domain | None) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_scalar(f"{key} key", k)
            _check_scalar(f"{key}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_scalar(f"{key}[{i}]", v)
    else:
        _check_scalar(key, value)
    if domain is None:
        return
    if isinstance(value, list):
        if domain.lengths and len(value) not in domain.lengths:
            raise ConfigError(f"{key}={value!r} is not allowed: must be {domain.describe()}")
        for i, v in enumerate(value):
            if not domain.test(v):
                raise ConfigError(f"{key}[{i}]={v!r} is not allowed: must be {domain.text}")
    elif not domain.test(value):
        raise ConfigError(f"{key}={value!r} is not allowed: must be {domain.describe()}")


def domain_of(f: dataclasses.Field) -> Domain | None:
    return f.metadata.get("domain")


def check_domains(cfg: Any) -> None:
    """Raise ConfigError naming the key, its value and the allowed domain for the first field outside it."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            _check_field(f"{section.name}.{f.name}", getattr(values, f.name), domain_of(f))
