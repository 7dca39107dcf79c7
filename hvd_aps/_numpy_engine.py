"""The codec's engine contract (its table functions) in vectorised NumPy: the fallback where the
compiled engine is missing, and a second, independently written implementation of ops/fpcodec.h
that the tests hold the others against.
"""
from typing import Optional, Tuple, Union

import numpy as np

from ._tables import Blocks
from .formats import FINITE, FN_NAN, IEEE, FloatFormat
from .scaling import shifts_under
from .config import Rounding

_U64 = np.uint64


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _random32(seeds: Union[np.ndarray, int], index: np.ndarray) -> np.ndarray:
    """The 32 random bits ops/fpcodec.h's hvd_random32 draws for (seeds[i], index[i]) for every i
    (seeds broadcast)."""
    with np.errstate(over="ignore"):
        z = _mix64(np.asarray(seeds, _U64)) + (np.asarray(index, np.int64).astype(_U64) + _U64(1)) * _U64(
            0x9E3779B97F4A7C15)
        return (_mix64(z) >> _U64(32)).astype(np.uint32)


def _limits(fmt: FloatFormat) -> Tuple[int, int, int]:
    all_ones = (1 << (fmt.exp_bits + fmt.man_bits)) - 1
    inf_code = ((1 << fmt.exp_bits) - 1) << fmt.man_bits
    return all_ones, inf_code, fmt.max_code


def _special_codes(a: np.ndarray, sign: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Codes for NaN/Inf inputs (a = |x| bits), matching ml_dtypes for every policy."""
    all_ones, inf_code, max_code = _limits(fmt)
    top = np.uint32(fmt.exp_bits + fmt.man_bits)
    is_inf = a == 0x7F800000
    if fmt.policy == IEEE:
        nan_mag = inf_code | ((1 << (fmt.man_bits - 1)) if fmt.man_bits else 0)
        return (sign << top) | np.where(is_inf, inf_code, nan_mag).astype(np.uint32)
    if fmt.policy == FN_NAN:
        return (sign << top) | np.uint32(all_ones)
    return np.where(is_inf, (sign << top) | np.uint32(max_code), (sign ^ np.uint32(1)) << top)


def _encode(x: np.ndarray, fmt: FloatFormat, shift: Union[np.ndarray, int], rounding: Union[Rounding, str],
            seed: Union[np.ndarray, int], saturate: bool, index: np.ndarray) -> np.ndarray:
    """Codes of x * 2**shift (x flat float32; shift one per element or one for all) as uint32.
    index: the stochastic hash's index of every element (seed one per element or one for all)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign, a = u >> np.uint32(31), u & np.uint32(0x7FFFFFFF)
    e32 = (a >> np.uint32(23)).astype(np.int64)
    sig = ((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)).astype(np.int64)
    sub = (e32 == 0) & (a != 0)
    if sub.any():  # float32 subnormals: normalise
        m = a[sub].astype(np.int64)
        p = np.floor(np.log2(m.astype(np.float64))).astype(np.int64)
        e32[sub] = p - 22
        sig[sub] = m << (23 - p)
    t = e32 - 127 + shift + fmt.bias - 1
    drop = np.where(t >= 0, 23 - fmt.man_bits, np.minimum(23 - fmt.man_bits - t, 56))
    base = np.where(t >= 0, np.minimum(t, 1 << fmt.exp_bits) << fmt.man_bits, 0)
    q = sig >> drop
    rem = sig - (q << drop)
    if Rounding(rounding) is Rounding.STOCHASTIC:
        rnd = _random32(seed, index).astype(np.int64)
        threshold = np.where(drop <= 32, rem << np.maximum(32 - drop, 0), rem >> np.maximum(drop - 32, 0))
        up = rnd < threshold
    else:
        half = np.int64(1) << (drop - 1)
        up = (rem > half) | ((rem == half) & ((base + q) & 1).astype(bool))  # even *code*
    mag = base + q + up
    _, inf_code, max_code = _limits(fmt)
    if saturate or fmt.policy == FINITE:
        overflow_mag = max_code
    else:
        overflow_mag = inf_code if fmt.policy == IEEE else _limits(fmt)[0]
    mag = np.where(mag > max_code, overflow_mag, mag).astype(np.uint32)
    codes = (sign << np.uint32(fmt.exp_bits + fmt.man_bits)) | mag
    codes = np.where(a == 0, sign << np.uint32(fmt.exp_bits + fmt.man_bits), codes)
    special = a >= 0x7F800000
    if special.any():
        codes[special] = _special_codes(a[special], sign[special], fmt)
    return codes


def _decode_table(fmt: FloatFormat, shift: int) -> np.ndarray:
    """float32 value of every code, times 2**-shift."""
    codes = np.arange(1 << fmt.bits, dtype=np.int64)
    m = fmt.man_bits
    sign = (codes >> (fmt.bits - 1)) & 1
    mag = codes & ((1 << (fmt.bits - 1)) - 1)
    ef, man = mag >> m, mag & ((1 << m) - 1)
    significand = np.where(ef > 0, man | (1 << m), man).astype(np.float64)
    exponent = np.maximum(ef, 1) - fmt.bias - m - shift
    with np.errstate(over="ignore"):  # the Inf/NaN slots, overwritten below
        values = np.ldexp(significand, exponent).astype(np.float32)  # exact, then one rounding
    values = np.where(sign == 1, -values, values)
    all_ones = (1 << (fmt.bits - 1)) - 1
    if fmt.policy == IEEE:
        top = ef == (1 << fmt.exp_bits) - 1
        values = np.where(top & (man == 0), np.copysign(np.inf, -sign + 0.5), values)
        values = np.where(top & (man != 0), np.copysign(np.nan, -sign + 0.5), values)
    elif fmt.policy == FN_NAN:
        values = np.where(mag == all_ones, np.copysign(np.nan, -sign + 0.5), values)
    return values.astype(np.float32)


# Block tables (hvd_aps._tables): every block's elements at once -----------------------------------
def _elements(blocks: Blocks) -> Tuple[np.ndarray, np.ndarray]:
    """(block of every element, its offset in the block) over the table's blocks in order."""
    counts = blocks.rows[:, 1]
    block = np.repeat(np.arange(blocks.count), counts)
    return block, np.arange(blocks.elements) - blocks.starts[:-1][block]


def _bit_positions(blocks: Blocks, bits: int, block: np.ndarray, within: np.ndarray) -> np.ndarray:
    return blocks.rows[block, 2] * 8 + (blocks.rows[block, 3] + within) * bits


def _codes_at_bits(message: np.ndarray, bits: int, where: np.ndarray) -> np.ndarray:
    """The `bits`-bit codes starting at bit positions `where` of a byte array."""
    byte = where >> 3
    word = np.zeros(where.shape, np.uint32)
    for k in range(3):  # bytes past the end only hold bits the mask drops
        word |= message[np.minimum(byte + k, message.size - 1)].astype(np.uint32) << np.uint32(8 * k)
    return (word >> (where & 7).astype(np.uint32)) & np.uint32((1 << bits) - 1)


def _values(fmt: FloatFormat, codes: np.ndarray, shifts: np.ndarray, divisor: np.float32 = np.float32(1)) -> np.ndarray:
    """Each code's value at its own exponent, divided by divisor in float32 as the tables are."""
    out = np.empty(codes.shape, np.float32)
    for shift in np.unique(shifts):
        chosen = shifts == shift
        out[chosen] = (_decode_table(fmt, int(shift)) / np.float32(divisor))[codes[chosen]]
    return out


def _block_peaks(values: np.ndarray, blocks: Blocks) -> np.ndarray:
    """max |v| of each block's run of `values` (the blocks' elements in order), +inf for NaN/Inf."""
    with np.errstate(invalid="ignore"):
        peaks = np.maximum.reduceat(np.abs(values), blocks.starts[:-1]) if blocks.count else values[:0]
    return np.where(np.isfinite(peaks), peaks, np.inf).astype(np.float32)


def table_amax(x: np.ndarray, blocks: Blocks) -> np.ndarray:
    block, within = _elements(blocks)
    return _block_peaks(x[blocks.rows[block, 0] + within], blocks)


def table_encode(x: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, rounding: Union[Rounding, str],
                 seeds: Optional[np.ndarray], saturate: bool, message: np.ndarray,
                 residual: Optional[np.ndarray] = None) -> np.ndarray:
    """Every block's codes placed bit by bit into its stream (the other bits of the bytes they
    touch kept)."""
    block, within = _elements(blocks)
    src = blocks.rows[block, 0] + within
    shifts_each = np.asarray(shifts, np.int64)[block]
    seed_each = np.asarray(seeds, _U64)[block] if Rounding(rounding) is Rounding.STOCHASTIC else 0
    codes = _encode(x[src], fmt, shifts_each, rounding, seed_each, saturate, blocks.rows[block, 4] + within)
    where = _bit_positions(blocks, fmt.bits, block, within)
    if fmt.bits == 8:
        message[where >> 3] = codes
    elif codes.size:
        stream = np.unpackbits(message, bitorder="little")
        for k in range(fmt.bits):
            stream[where + k] = (codes >> np.uint32(k)) & np.uint32(1)
        message[...] = np.packbits(stream, bitorder="little")
    if residual is not None:
        residual[src] = x[src] - _values(fmt, codes, shifts_each)
    return message


def table_sum(rows: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Each rank's codes decoded at its block's exponent, added in rank order from +0.0."""
    block, within = _elements(blocks)
    shifts_each = np.asarray(shifts, np.int64)[block]
    where = _bit_positions(blocks, fmt.bits, block, within)
    total = np.zeros(blocks.elements, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf sums: the host's alike
        for row in rows:
            total += _values(fmt, _codes_at_bits(np.ascontiguousarray(row), fmt.bits, where), shifts_each)
    out[blocks.rows[block, 0] + within] = total
    return _block_peaks(total, blocks)


def table_decode(message: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, out: np.ndarray,
                 divisor: np.float32 = np.float32(1), stream: bool = False) -> np.ndarray:
    block, within = _elements(blocks)
    codes = _codes_at_bits(message, fmt.bits, _bit_positions(blocks, fmt.bits, block, within))
    out[blocks.rows[block, 0] + within] = _values(fmt, codes, np.asarray(shifts, np.int64)[block], divisor)
    return out


def table_shifts(peaks: np.ndarray, limit: float, exponents: np.ndarray) -> np.ndarray:
    """Each block's APS shift from its peak (scaling.shifts_under), as int32, its little-endian
    int16 exponent written into `exponents` (2 bytes a block)."""
    shifts = shifts_under(np.asarray(peaks, np.float32), limit).astype(np.int32)
    exponents[...] = shifts.astype("<i2").view(np.uint8)
    return shifts


def table_stats(x: np.ndarray, message: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray,
                first: np.ndarray, step: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Per block: samples, nonzero inputs, nonzero values sent, inputs beyond the limit, and the
    float64 sums of (sent - input)^2 and input^2 over its elements first, first + step, ..."""
    counts = blocks.rows[:, 1]
    taken = np.maximum(0, -(-(counts - first) // step))
    block = np.repeat(np.arange(blocks.count), taken)
    within = first[block] + (np.arange(block.size) - np.concatenate([[0], np.cumsum(taken)])[:-1][block]) * step[block]
    v = x[blocks.rows[block, 0] + within]
    codes = _codes_at_bits(message, fmt.bits, _bit_positions(blocks, fmt.bits, block, within))
    sent = _values(fmt, codes, np.asarray(shifts, np.int64)[block])
    limit = np.asarray(limits, np.float32)[block]
    diff = sent.astype(np.float64) - v.astype(np.float64)
    columns = [np.ones(v.size), v != 0, sent != 0, (v > limit) | (v < -limit), diff * diff,
               v.astype(np.float64) ** 2]
    return np.stack([np.bincount(block, weights=c, minlength=blocks.count) for c in columns], axis=1)
