import numpy as np
import pytest

import hvd_aps

FORMATS = ["e4m3", "e5m2", "e3m0", "e2m1fn", "bf16"]


def neighbours(x, fmt):
    """The grid values just below and just above each x (finite grid only)."""
    table = hvd_aps.decode(np.arange(1 << fmt.bits, dtype=fmt.code_dtype), fmt)
    g = np.unique(table[np.isfinite(table)].astype(np.float64))
    hi = np.clip(np.searchsorted(g, x), 0, len(g) - 1)
    lo = np.clip(np.searchsorted(g, x, side="right") - 1, 0, len(g) - 1)
    return g[lo], g[hi]


@pytest.mark.parametrize("name", FORMATS)
def test_unbiased(name, engine):
    fmt = hvd_aps.FloatFormat.parse(name)
    rng = np.random.default_rng(4)
    points = (rng.uniform(-1, 1, 8) * fmt.max / 4).astype(np.float32)
    points[-1] = fmt.min_subnormal * 0.3  # a value that only rounds to 0 or the smallest subnormal
    reps = 40_000
    q = hvd_aps.quantize(np.repeat(points, reps), fmt, "stochastic", seed=11).reshape(8, reps)
    lo, hi = neighbours(points.astype(np.float64), fmt)
    p = np.where(hi > lo, (points - lo) / np.where(hi > lo, hi - lo, 1), 0)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / reps)
    err = np.abs(q.astype(np.float64).mean(axis=1) - points)
    assert (err <= 5 * sigma + 1e-12 * np.abs(points)).all(), (err, sigma)


@pytest.mark.parametrize("name", FORMATS)
def test_always_a_neighbour(name, engine):
    fmt = hvd_aps.FloatFormat.parse(name)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(100_000) * fmt.max / 8 * np.exp2(rng.uniform(-30, 0, 100_000))).astype(np.float32)
    q = hvd_aps.quantize(x, fmt, "stochastic", seed=3).astype(np.float64)
    lo, hi = neighbours(x.astype(np.float64), fmt)
    assert ((q == lo) | (q == hi)).all()


def test_seed_reproducible_and_engines_agree(monkeypatch):
    rng = np.random.default_rng(6)
    n = 1_200_000  # large enough that the host engine splits it across threads
    x = (rng.standard_normal(n) * np.exp2(rng.uniform(-40, 5, n))).astype(np.float32)
    results = {}
    for engine in ("numpy", "host"):
        monkeypatch.setenv("HVD_APS_ENGINE", engine)
        results[engine] = [hvd_aps.encode(x, "e4m3", "stochastic", seed=s, shift=30) for s in (7, 7, 8)]
    for a, b, c in results.values():
        assert (a == b).all() and (a != c).any()
    assert all((u == v).all() for u, v in zip(results["numpy"], results["host"]))


def test_fresh_seed_when_none(engine):
    x = np.full(1000, 0.3, np.float32)
    a, b = (hvd_aps.encode(x, "e4m3", "stochastic") for _ in range(2))
    assert (a != b).any()
