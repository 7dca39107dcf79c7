import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import hvd_aps
from hvd_aps import FloatFormat
from conftest import twin_dtype

TWINNED = [f for f in hvd_aps.PRESETS.values() if f.ml_dtypes_name]


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_limits_match_ml_dtypes(fmt):
    info = ml_dtypes.finfo(twin_dtype(fmt))
    assert fmt.bits == info.bits
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.max_exponent == int(np.floor(np.log2(float(info.max))))


def test_presets_and_names():
    assert (hvd_aps.e4m3.max, hvd_aps.e4m3fn.max, hvd_aps.e5m2.max) == (240.0, 448.0, 57344.0)
    assert (hvd_aps.e3m0.bits, hvd_aps.e3m0.max, hvd_aps.e3m0.min_subnormal) == (4, 8.0, 0.25)
    assert FloatFormat.parse("fp16") == hvd_aps.fp16 == FloatFormat(5, 10)
    assert FloatFormat.parse("BF16") == hvd_aps.bf16 == FloatFormat(8, 7)
    assert hvd_aps.e2m1fn.policy == 2 and not hvd_aps.e2m1fn.has_nan
    assert hvd_aps.e4m3fn.has_nan and not hvd_aps.e4m3fn.has_inf
    assert hvd_aps.e3m0.has_inf and not hvd_aps.e3m0.has_nan


@given(st.integers(1, 8), st.integers(0, 15), st.sampled_from(["ieee", "fn"]))
def test_parse_str_round_trip(exp_bits, man_bits, variant):
    try:
        fmt = FloatFormat(exp_bits, man_bits, variant)
    except ValueError:
        assert exp_bits + man_bits > 15 or (exp_bits, man_bits, variant) == (1, 0, "ieee")
        return
    assert FloatFormat.parse(str(fmt)) == fmt
    assert hash(FloatFormat.parse(str(fmt))) == hash(fmt)


@pytest.mark.parametrize("name, match", [
    ("e9m2", "exp_bits must be in 1..8"), ("e0m3", "exp_bits must be in 1..8"),
    ("e8m8", "at most 16 bits"), ("e4m24", "man_bits must be in 0..23"),
    ("e1m0", "no finite nonzero value"), ("float8", "unknown format"), ("e4m3x", "unknown format")])
def test_bad_names(name, match):
    with pytest.raises(ValueError, match=match):
        FloatFormat.parse(name)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="exp_bits must be an int"):
        FloatFormat(4.0, 3)
    with pytest.raises(ValueError, match="variant"):
        FloatFormat(4, 3, "fnuz")
    with pytest.raises(TypeError, match="must be a str"):
        FloatFormat.parse(43)
