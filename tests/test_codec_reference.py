"""Formats ml_dtypes lacks, against a slow reference written from the definition: enumerate the
grid, take the nearest value, break ties towards the even code, then apply the overflow policy."""
import numpy as np
import pytest

import hvd_aps
from hvd_aps import FloatFormat
from conftest import same_bits

UNTWINNED = ["e3m0", "e2m0", "e4m0", "e5m3", "e3m0fn", "e5m1fn", "e2m2", "e6m1", "e4m4fn", "e7m8", "e1m2fn", "e1m2"]


def reference_values(fmt):
    """Value of every positive finite code 0..max_code, from the format's definition."""
    values = []
    for code in range(fmt.max_code + 1):
        e, m = divmod(code, 1 << fmt.man_bits)
        if e == 0:
            values.append(m / 2 ** fmt.man_bits * 2.0 ** (1 - fmt.bias))
        else:
            values.append((1 + m / 2 ** fmt.man_bits) * 2.0 ** (e - fmt.bias))
    return np.array(values)


def reference_encode(x, fmt, saturate=False):
    with np.errstate(invalid="ignore"):  # signalling-NaN payloads among the float16 inputs
        x = np.asarray(x, np.float64)
    values = reference_values(fmt)
    extended = np.append(values, fmt.max + fmt.max_ulp)  # the virtual next value
    a = np.abs(x)
    hi = np.clip(np.searchsorted(extended, a), 1, len(extended) - 1)
    lo = hi - 1
    dlo, dhi = a - extended[lo], extended[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= extended[-1], len(extended) - 1, code)
    all_ones = (1 << (fmt.bits - 1)) - 1
    inf_code = ((1 << fmt.exp_bits) - 1) << fmt.man_bits
    overflow = {0: inf_code, 1: all_ones, 2: fmt.max_code}[fmt.policy]
    code = np.where(code > fmt.max_code, fmt.max_code if saturate else overflow, code)
    code = np.where(np.isinf(x), {0: inf_code, 1: all_ones, 2: fmt.max_code}[fmt.policy], code)
    nan_code = {0: inf_code | ((1 << fmt.man_bits - 1) if fmt.man_bits else 0), 1: all_ones, 2: 0}[fmt.policy]
    code = np.where(np.isnan(x), nan_code, code)
    sign = np.signbit(x) ^ (np.isnan(x) & (fmt.policy == 2))
    return code | (sign.astype(np.int64) << (fmt.bits - 1))


def reference_decode(fmt):
    values = reference_values(fmt).astype(np.float32)
    table = np.full(1 << (fmt.bits - 1), np.nan, np.float32)
    table[:len(values)] = values
    if fmt.policy == 0:
        table[((1 << fmt.exp_bits) - 1) << fmt.man_bits] = np.inf
    return np.concatenate([table, -table])


def inputs(fmt):
    values = reference_values(fmt)
    mids = (values[:-1] + values[1:]) / 2
    points = np.concatenate([values, mids, [fmt.max + fmt.max_ulp / 2]])
    points = np.concatenate([points, -points]).astype(np.float32)
    rng = np.random.default_rng(3)
    with np.errstate(over="ignore"):
        wide = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-150, 129, 200_000))).astype(np.float32)
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    return np.concatenate([points, np.nextafter(points, np.float32(np.inf)),
                           np.nextafter(points, np.float32(-np.inf)), wide, f16,
                           np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan])])


@pytest.mark.parametrize("name", UNTWINNED)
def test_encode_matches_reference(name, engine):
    fmt = FloatFormat.parse(name)
    x = inputs(fmt)
    for saturate in (False, True):
        got = hvd_aps.encode(x, fmt, saturate=saturate).astype(np.int64)
        want = reference_encode(x, fmt, saturate)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, f"x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


@pytest.mark.parametrize("name", UNTWINNED)
def test_decode_matches_reference(name, engine):
    fmt = FloatFormat.parse(name)
    codes = np.arange(1 << fmt.bits, dtype=fmt.code_dtype)
    assert same_bits(hvd_aps.decode(codes, fmt), reference_decode(fmt)).all()


def test_man_bits_zero_ties_go_to_the_even_code(engine):
    # e3m0 holds 0, .25, .5, 1, 2, 4, 8 as codes 0..6; 7 is Inf
    x = np.float32([0.125, 0.375, 0.75, 1.5, 3.0, 6.0, 12.0])
    assert hvd_aps.encode(x, "e3m0").tolist() == [0, 2, 2, 4, 4, 6, 6]
