"""Comparison helpers for the kernel tests: failures name the worst element."""

from __future__ import annotations

import numpy as np


def assert_close(got, expected, *, atol: float, rtol: float, name: str = "output") -> None:
    """|got - expected| <= atol + rtol * |expected| element-wise (NaN/inf in `got` fail).
    On failure: how many elements fail and the worst one (index, got, expected, error)."""
    g = np.asarray(got, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert g.shape == e.shape, f"{name}: shape {g.shape} != expected {e.shape}"
    if g.size == 0:
        return
    err = np.abs(g - e)
    tol = atol + rtol * np.abs(e)
    bad = ~(err <= tol)  # NaN compares False -> bad
    if not bad.any():
        return
    excess = np.where(np.isnan(err), np.inf, err - tol)
    worst = np.unravel_index(int(np.argmax(excess)), g.shape)
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {g.size} elements outside atol={atol:g} rtol={rtol:g}; worst at "
        f"{tuple(int(i) for i in worst)}: got {g[worst]!r}, expected {e[worst]!r}, "
        f"|diff| {err[worst]!r} (max |diff| overall {np.nanmax(err) if not np.isnan(err).all() else np.nan!r})")


def assert_equal(got, expected, *, name: str = "output") -> None:
    """Exact equality; on failure: count and the first mismatching element."""
    g = np.asarray(got)
    e = np.asarray(expected)
    assert g.shape == e.shape, f"{name}: shape {g.shape} != expected {e.shape}"
    neq = g != e
    if g.dtype.kind == "f" or e.dtype.kind == "f":
        neq &= ~(np.isnan(g.astype(np.float64)) & np.isnan(e.astype(np.float64)))
    if not neq.any():
        return
    first = tuple(int(i) for i in np.argwhere(neq)[0])
    raise AssertionError(f"{name}: {int(neq.sum())} of {g.size} elements differ; first at {first}: "
                         f"got {g[first]!r}, expected {e[first]!r}")
