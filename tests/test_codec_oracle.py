"""The codec against things nobody here wrote: ml_dtypes' and NumPy's casts, code by code."""
import numpy as np
import pytest

import hvd_aps
from conftest import same_bits, twin_dtype

TWINNED = [f for f in hvd_aps.PRESETS.values() if f.ml_dtypes_name]


def oracle_codes(x, fmt):
    with np.errstate(all="ignore"):
        y = np.asarray(x, np.float32).astype(twin_dtype(fmt))
    return y.view(np.uint8 if fmt.bits <= 8 else np.uint16).astype(np.int64)


def check_encode(x, fmt):
    x = np.asarray(x, np.float32)
    got = hvd_aps.encode(x, fmt).astype(np.int64)
    want = oracle_codes(x, fmt)
    if fmt.ml_dtypes_name == "float16":  # NumPy keeps NaN payload bits; the codec canonicalises
        nan = np.isnan(x)
        assert same_bits(hvd_aps.decode(got[nan], fmt), x[nan].astype(np.float16)).all()
        x, got, want = x[~nan], got[~nan], want[~nan]
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


def grid(fmt):
    """Every finite value of fmt, from its twin type."""
    codes = np.arange(1 << fmt.bits, dtype=np.uint8 if fmt.bits <= 8 else np.uint16)
    values = codes.view(twin_dtype(fmt)).astype(np.float32)
    return np.unique(values[np.isfinite(values)])


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_decode_every_code(fmt, engine):
    codes = np.arange(1 << fmt.bits, dtype=fmt.code_dtype)
    want = codes.view(np.uint8 if fmt.bits <= 8 else np.uint16).view(twin_dtype(fmt)).astype(np.float32)
    assert same_bits(hvd_aps.decode(codes, fmt), want).all()


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1fn", "e3m0", "e5m10"])
@pytest.mark.parametrize("shift", [0, 9, -17])
def test_float16_values_are_numpys_cast_of_the_float32_ones(name, shift, engine):
    """decode and quantize with dtype=float16 give what NumPy's cast of their float32 values
    gives, also where the shift rounds them onto float16's subnormals or past its range."""
    fmt = hvd_aps.FloatFormat.parse(name)
    codes = np.arange(1 << fmt.bits, dtype=fmt.code_dtype)
    with np.errstate(over="ignore"):  # values past float16's range: Inf, as the cast has them
        want = hvd_aps.decode(codes, fmt, shift).astype(np.float16)
    assert same_bits(hvd_aps.decode(codes, fmt, shift, dtype=np.float16), want).all()
    out = np.empty(codes.shape, np.float16)
    assert hvd_aps.decode(codes, fmt, shift, dtype=np.float16, out=out) is out and same_bits(out, want).all()
    x = np.random.default_rng(7).standard_normal(5001).astype(np.float32) * 3
    with np.errstate(over="ignore"):
        want = hvd_aps.quantize(x, fmt, shift=shift).astype(np.float16)
    assert same_bits(hvd_aps.quantize(x, fmt, shift=shift, dtype=np.float16), want).all()


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_encode_every_float16(fmt, engine):
    check_encode(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32), fmt)


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_encode_straddles_values_and_midpoints(fmt, engine):
    g = grid(fmt).astype(np.float64)
    mids = (g[:-1] + g[1:]) / 2  # exact: a grid value has at most 8 significant bits
    beyond = np.array([fmt.max + (fmt.max - g[-2]) / 2])  # the overflow tie
    points = np.concatenate([g, mids, beyond, -g, -mids, -beyond]).astype(np.float32)
    assert (points.astype(np.float64) == np.concatenate([g, mids, beyond, -g, -mids, -beyond])).all()
    near = [points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf))]
    check_encode(np.concatenate(near), fmt)


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_encode_specials_and_float32_subnormals(fmt, engine):
    rng = np.random.default_rng(1)
    subnormals = rng.integers(1, 1 << 23, 20000, dtype=np.uint32).view(np.float32)
    big = min(fmt.max * 1.01, 3.4028235e38)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.4e-45, -1.4e-45, 1.1754942e-38,
                         3.4028235e38, -3.4028235e38, big, -big], np.float32)
    check_encode(np.concatenate([specials, subnormals, -subnormals]), fmt)


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_encode_random_wide_range(fmt, engine):
    rng = np.random.default_rng(2)
    n = 1_000_000
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * np.exp2(rng.uniform(-150, 129, n))).astype(np.float32)
    check_encode(x, fmt)


@pytest.mark.parametrize("fmt", TWINNED, ids=str)
def test_saturate_clamps_finite_overflow_only(fmt, engine):
    big = min(fmt.max * 3, float(np.finfo(np.float32).max))
    x = np.array([big, -big, np.inf, np.nan], np.float32)
    y = hvd_aps.quantize(x, fmt, saturate=True)
    assert y[0] == fmt.max and y[1] == -fmt.max
    if fmt.has_inf:
        assert y[2] == np.inf
    elif fmt.has_nan:
        assert np.isnan(y[2])
    else:
        assert y[2] == fmt.max


def test_wider_inputs_are_converted(engine):
    x = np.array([0.3, -1.7, 1e-3], np.float64)
    want = hvd_aps.encode(x.astype(np.float32), "e4m3")
    assert (hvd_aps.encode(x, "e4m3") == want).all()
    assert (hvd_aps.encode(x.astype(np.float16), "e4m3") == hvd_aps.encode(x.astype(np.float16).astype(np.float32), "e4m3")).all()
    import ml_dtypes
    assert (hvd_aps.encode(x.astype(ml_dtypes.bfloat16), "e5m2") ==
            hvd_aps.encode(x.astype(ml_dtypes.bfloat16).astype(np.float32), "e5m2")).all()


def test_shapes_are_kept(engine):
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    assert hvd_aps.encode(x, "e4m3").shape == (2, 3, 4)
    assert hvd_aps.quantize(x, "e4m3").shape == (2, 3, 4)
    assert hvd_aps.encode(x[:, ::2], "e4m3").shape == (2, 2, 4)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 9])  # the host engine: up to four in one pass, more four at a time
@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e3m2fn", "fp16"])  # 8, 4, 6 and 16 bits
def test_decode_sum_rows_adds_ml_dtypes_values_in_rank_order(name, ranks, engine):
    """Packed rows lying apart in one buffer (as an alltoall's received bytes do), sliced at odd
    starts: the sums equal ml_dtypes' values times 2**-shift added in rank order from +0.0, the
    max comes with them, and decode_row keeps signed zeros."""
    fmt, shift, n = hvd_aps.FloatFormat.parse(name), 3, 1001
    rng = np.random.default_rng(11)
    values = [(rng.standard_normal(n) * rng.choice([0, 1e-3, 1, 3], n)).astype(np.float32) for _ in range(ranks)]
    codes = [oracle_codes(v, fmt).astype(fmt.code_dtype) for v in values]
    size = hvd_aps.packed_size(n, fmt)
    buffer = np.zeros((ranks, size + 7), np.uint8)
    for r in range(ranks):
        buffer[r, 2:2 + size] = hvd_aps.pack(codes[r], fmt)
    rows = buffer[:, 2:2 + size]
    for start, stop in [(0, n), (1, n - 1), (7, 7), (3, 500)]:
        terms = [np.ldexp(v.astype(twin_dtype(fmt)).astype(np.float32)[start:stop], -shift) for v in values]
        want = np.zeros(stop - start, np.float32)
        for t in terms:
            want = want + t
        got, peak = hvd_aps.codec.decode_sum_rows(rows, fmt, start, stop, shift)
        assert same_bits(got, want).all() and peak == (float(np.abs(want).max()) if want.size else 0.0)
        assert same_bits(hvd_aps.codec.decode_row(rows[-1], fmt, start, stop, shift), terms[-1]).all()
        for stream in (False, True):  # through the cache, and past it (non-temporal stores) from an odd address
            out = np.empty(stop - start + 1, np.float32)[1:]
            hvd_aps.codec.decode_row(rows[-1], fmt, start, stop, shift, out=out, divisor=ranks, stream=stream)
            assert same_bits(out, terms[-1] / np.float32(ranks)).all()
    assert np.signbit(values[-1][values[-1] == 0]).any()  # -0 among the codes decode_row must keep
    with pytest.raises(ValueError, match="need"):
        hvd_aps.codec.decode_sum_rows(rows, fmt, 0, n + 20)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e3m2fn", "fp16"])  # 8, 4, 6 and 16 bits
def test_encode_into_writes_pieces_of_one_packed_stream(name, rounding, engine):
    """Pieces of a tensor encoded straight into their places of one packed stream, in shuffled
    order, with cuts at odd positions and each piece long enough for the host engine's threads:
    the stream equals ml_dtypes' codes (nearest) or one encode() with the same seed (stochastic)
    packed, so no piece touched its neighbours' bits; codes_at reads a sample back. The stream
    starts at an odd byte of its buffer, as a part of a message may (16-bit codes unaligned)."""
    fmt, n, rng = hvd_aps.FloatFormat.parse(name), 1_200_003, np.random.default_rng(12)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1, 30], n)).astype(np.float32)
    codes = (oracle_codes(x, fmt) if rounding == "nearest" else hvd_aps.encode(x, fmt, rounding, seed=5)).astype(fmt.code_dtype)
    bounds = [0, 1, 9, 555_555, 555_562, 1_199_990, n]
    row = np.full(hvd_aps.packed_size(n, fmt) + 1, 0xA5, np.uint8)[1:]  # bits no piece may leave as they are
    for k in rng.permutation(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        assert hvd_aps.codec.encode_into(x[a:b], fmt, row, a, rounding, seed=5, index=a) is row
    want = hvd_aps.pack(codes, fmt)
    tail = n * fmt.bits % 8  # bits of the last byte past the last code: left as they were
    keep = np.full(row.size, 0xFF, np.uint8)
    keep[-1] = (1 << tail) - 1 if tail else 0xFF
    assert np.array_equal(row & keep, want & keep)
    positions = np.arange(3, n, 9973)
    assert np.array_equal(hvd_aps.codec.codes_at(row, fmt, positions), codes[positions])
    with pytest.raises(ValueError, match="need"):
        hvd_aps.codec.encode_into(x[:10], fmt, row, n - 5)
    with pytest.raises(TypeError, match="contiguous"):
        hvd_aps.codec.encode_into(x[:10], fmt, np.zeros(64, np.uint8)[::2], 0)


@pytest.mark.parametrize("name", ["e4m3", "e2m1fn", "e3m2fn", "fp16"])  # 8, 4, 6 and 16 bits
def test_blocked_runs_give_every_block_its_own_exponent(name, engine):
    """encode_into / decode_row with one shift per block of 2048 codes and decode_sum_rows' max
    per block, against ml_dtypes block by block: what the exchange's per-block re-encode needs."""
    fmt, n, block = hvd_aps.FloatFormat.parse(name), 700_001, 2048  # large enough for the host engine's threads
    rng = np.random.default_rng(13)
    x = (rng.standard_normal(n) * rng.choice([0, 1e-3, 1, 3], n)).astype(np.float32)
    shifts = rng.integers(-4, 5, -(-n // block))
    twin = twin_dtype(fmt)
    row = np.zeros(hvd_aps.packed_size(n + 5, fmt), np.uint8)
    hvd_aps.codec.encode_into(x, fmt, row, 5, shift=shifts, block=block)
    per_element = np.repeat(shifts, block)[:n]
    want = np.ldexp(np.ldexp(x, per_element).astype(twin).astype(np.float32), -per_element)
    got = hvd_aps.codec.decode_row(row, fmt, 5, n + 5, shift=shifts, block=block, divisor=3)
    assert same_bits(got, want / np.float32(3)).all()
    rows = np.stack([row, row])
    sums, peaks = hvd_aps.codec.decode_sum_rows(rows, fmt, 5, n + 5, shift=2, block=block)
    values = np.ldexp(np.ldexp(x, per_element).astype(twin).astype(np.float32), -2)  # the codes' values, at shift 2
    assert same_bits(sums, (np.zeros_like(values) + values) + values).all()  # from +0.0, in rank order
    assert (peaks == np.array([np.abs(sums[k:k + block]).max() for k in range(0, n, block)], np.float32)).all()
    assert (hvd_aps.codec.amax_blocks(x, block) == peaks.dtype.type(0) + np.array(
        [np.abs(x[k:k + block]).max() for k in range(0, n, block)], np.float32)).all()
    with pytest.raises(ValueError, match="integer shifts"):
        hvd_aps.codec.encode_into(x, fmt, row, 5, shift=shifts[:-1], block=block)
