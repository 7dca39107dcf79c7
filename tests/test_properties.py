"""Property tests (hypothesis) over arbitrary formats and inputs."""
import os

import numpy as np
from hypothesis import assume, given, settings, strategies as st

import hvd_aps
from hvd_aps import FloatFormat, scaling
from conftest import ENGINES

formats = st.tuples(st.integers(1, 8), st.integers(0, 7), st.sampled_from(["ieee", "fn"]))


def make(t):
    try:
        return FloatFormat(*t)
    except ValueError:
        assume(False)


@settings(max_examples=60, deadline=None)
@given(formats, st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=50))
def test_quantize_is_the_nearest_grid_value(t, xs):
    fmt = make(t)
    table = hvd_aps.decode(np.arange(1 << fmt.bits, dtype=fmt.code_dtype), fmt).astype(np.float64)
    grid = np.unique(table[np.isfinite(table)])
    x = np.array(xs, np.float32)
    # up to the largest grid value float32 holds (e8mXfn reaches 2^128, which decodes to Inf)
    x = x[np.abs(x.astype(np.float64)) <= min(fmt.max, grid.max())]
    assume(x.size)
    q = hvd_aps.quantize(x, fmt).astype(np.float64)
    best = np.min(np.abs(grid[None, :] - x[:, None].astype(np.float64)), axis=1)
    assert np.isin(q, grid).all()
    assert (np.abs(q - x) == best).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 15), st.integers(0, 300), st.data())
def test_pack_unpack_round_trip(exp_bits, man_bits, n, data):
    try:
        fmt = FloatFormat(exp_bits, man_bits, "fn")
    except ValueError:
        assume(False)
    codes = np.array(data.draw(st.lists(st.integers(0, (1 << fmt.bits) - 1), min_size=n, max_size=n)),
                     dtype=fmt.code_dtype)
    results = []
    for engine in ENGINES:  # the compiled engine and NumPy write the same stream
        os.environ["HVD_APS_ENGINE"] = engine
        try:
            packed = hvd_aps.pack(codes, fmt)
            assert packed.dtype == np.uint8 and packed.size == hvd_aps.packed_size(n, fmt) == -(-n * fmt.bits // 8)
            assert (hvd_aps.unpack(packed, fmt, n) == codes).all()
            results.append(packed)
        finally:
            del os.environ["HVD_APS_ENGINE"]
    assert all((r == results[0]).all() for r in results)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, width=32, exclude_min=True, allow_infinity=False, allow_nan=False), st.integers(1, 4096),
       st.sampled_from(sorted(hvd_aps.PRESETS)), st.sampled_from([None, 65504.0, 3.4028234663852886e38]))
def test_aps_shift_fits_the_sum_and_wastes_under_one_binade(amax, n, name, sum_max):
    fmt = hvd_aps.PRESETS[name]
    s = scaling.shift_for(amax, n, fmt, sum_max)
    limit = fmt.max if sum_max is None else sum_max
    term = amax * 2.0 ** s  # exact in float64
    rounded = float(hvd_aps.quantize(np.array([amax], np.float32), fmt, shift=s, unscale=False)[0])
    half_ulp = lambda v: max(v * 2.0 ** -(fmt.man_bits + 1), fmt.min_subnormal / 2)  # rounding's worst case
    assert term <= fmt.max
    if n * fmt.min_subnormal < limit:  # otherwise the format cannot hold a sum of n terms at all
        assert n * rounded <= limit  # the N-way sum of the rounded terms fits ...
        assert 2 * term > fmt.max or n * (2 * term + half_ulp(2 * term)) > limit  # ... one more binade would not
