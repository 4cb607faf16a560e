"""Exact one-sided 95 % bounds on a rate from a count (Clopper-Pearson), with the standard library only.

A page that reports "0 false reports in 8 runs" reports with it how high the per-run rate could still be
(`upper`: 31 % there), and "49 of 49 named" how low the naming rate could be (`lower`)."""

from __future__ import annotations

from math import comb

CONFIDENCE = 0.95


def _at_most(x: int, n: int, p: float) -> float:
    """P(X <= x) for X ~ Binomial(n, p)."""
    return sum(comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(x + 1))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the decreasing f(p) crosses target (bisection to 1e-9)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if f(mid) > target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def upper(x: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The rate's one-sided upper bound after x events in n trials: P(X <= x) = 1 - confidence there."""
    if not 0 <= x <= n or n == 0:
        raise ValueError(f"a count of {x} in {n} trials has no bound")
    return 1.0 if x == n else _solve(lambda p: _at_most(x, n, p), 1 - confidence)


def lower(x: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The rate's one-sided lower bound after x events in n trials: P(X >= x) = 1 - confidence there."""
    return 1.0 - upper(n - x, n, confidence)


def rate(x: int, n: int, bound: str) -> str:
    """'x of n (95 % upper bound 31 %)': a count with the bound the page reports beside it."""
    value = upper(x, n) if bound == "upper" else lower(x, n)
    return f"{x} of {n} ({100 * CONFIDENCE:.0f} % {bound} bound {100 * value:.0f} %)"
