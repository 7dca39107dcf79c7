"""encode / decode / quantize between float32 and a FloatFormat's codes, plus sub-byte packing.

Arrays on a CUDA device (CuPy arrays, CUDA torch tensors, anything exporting DLPack from a CUDA
device) are converted zero-copy and handled by the CuPy engine, and results come back as CuPy
arrays; everything else goes through NumPy and the compiled CPU engine.

Semantics (every engine, bit for bit): round to nearest with ties to the even code (also when
man_bits=0, where "even" is the exponent's last bit), gradual underflow, signed zero, and NaN,
Inf and overflow exactly as ml_dtypes' `astype` treats them for every format it has. The APS
`shift` multiplies the input by 2**shift inside the conversion (and decode multiplies by
2**-shift), so scaling never rounds on its own.

Blocked runs: encode_into, decode_sum_rows and decode_row take `block`, cutting their codes into
blocks of that many (the last may be shorter), each with its own exponent (`shift` then holds one
per block) or its own max: the codes exchange re-encodes every block of a tensor at its own
exponent, so its numbers do not depend on how buckets are cut into chunks and shards.

The engine contract (_host_engine, _numpy_engine, _cupy_engine), on inputs this module has
already checked (fmt a FloatFormat, shift and seed ints, shifts an int32 NumPy array of one
exponent per block, `out` None or an array that fits; the format and scale come right after the
data, unlike the public functions' keyword order)::

    encode(x, fmt, shift, rounding, seed, saturate, out) -> codes
    encode_into(x, fmt, shifts, block, rounding, seed, saturate, row, pos, index) -> row
    decode(codes, fmt, shift, dtype, out) -> values
    decode_accumulate(codes, fmt, shift, out) -> sums over the leading axis, added to out
    sum_rows(rows, fmt, start, stop, shift, block, out) -> (sums, float32 max |sums| per block)
    decode_row(row, fmt, start, stop, shifts, block, out, divisor, stream) -> values
    pack(codes, bits), unpack(packed, bits, n, dtype), amax(x), amax_blocks(x, block) -> float32 maxima

and, for the codes exchange, one call per stage of a bucket over a table of its blocks
(hvd_aps._tables.Blocks: each block's place in the float32 array, in a packed stream, and its
stochastic index), with one exponent (and seed) per block, checked once per bucket layout::

    table_amax(x, blocks) -> max |x| per block (+inf where non-finite)
    table_encode(x, fmt, blocks, shifts, rounding, seeds, saturate, message, residual) -> message
    table_sum(rows, fmt, blocks, shifts, out) -> max |sum| per block (rows: (ranks, bytes))
    table_decode(message, fmt, blocks, shifts, out, divisor, stream) -> out
    table_stats(x, message, fmt, blocks, shifts, first, step, limits) -> (blocks, 6) float64 sums
"""
import functools
import os
import secrets
import warnings

import numpy as np

from . import _host_engine, _numpy_engine
from ._arrays import array_module, as_array
from .config import Rounding
from .formats import FloatFormat

_INPUT_KINDS = "fiub"  # float, signed, unsigned, bool: numbers NumPy converts exactly or by rounding
# How wide the CPU engine's calls run (the other engines have no threads of their own): one
# thread for exchanges beside the step's compute, every thread while the step waits for them
beside_compute, awaited = _host_engine.beside_compute, _host_engine.awaited


def engine_for(a):
    """The engine for arrays like `a`: the CuPy engine on a CUDA device, else the CPU's. The
    exchange's stages call its table functions directly, their arguments checked once per
    bucket layout (hvd_aps._tables) rather than per call."""
    if array_module(a) is not np:
        from . import _cupy_engine
        return _cupy_engine
    return _engine()


def _engine():
    choice = os.environ.get("HVD_APS_ENGINE", "auto")
    if choice not in ("auto", "host", "numpy"):
        raise ValueError(f"HVD_APS_ENGINE must be auto, host or numpy, got {choice!r}")
    if choice == "numpy":
        return _numpy_engine
    if choice == "auto" and not _host_engine.available:
        _warn_numpy_fallback()
        return _numpy_engine
    if not _host_engine.available:
        raise RuntimeError("HVD_APS_ENGINE=host but the compiled engine is not built; "
                           "reinstall hvd_aps with a C compiler present")
    return _host_engine


@functools.lru_cache(maxsize=None)
def _warn_numpy_fallback():
    """Once per process: a source tree without the built host engine runs, but slower."""
    warnings.warn("hvd_aps: the compiled host engine (ops/host.c) is not built, so the NumPy engine "
                  "runs instead, about 2.5x slower; build it with `pip install -e .` where a C compiler "
                  "is present (HVD_APS_ENGINE=numpy picks NumPy on purpose and silences this)",
                  RuntimeWarning, stacklevel=4)


def engine_name():
    """Which engine NumPy inputs use: "host" (compiled ops/host.c) or "numpy"."""
    return "host" if _engine() is _host_engine else "numpy"


def _as_float32(x):
    x = as_array(x)
    if x.dtype.kind not in _INPUT_KINDS and x.dtype.name != "bfloat16":
        raise TypeError(f"expected a numeric array, got dtype {x.dtype}")
    return array_module(x).ascontiguousarray(x, dtype=np.float32)


def _check_shift(shift):
    if not isinstance(shift, (int, np.integer)) or not -1000 <= shift <= 1000:
        raise ValueError(f"shift must be an int in -1000..1000, got {shift!r}")
    return int(shift)


def _check_seed(rounding, seed):
    if rounding not in [r.value for r in Rounding]:
        raise ValueError(f"rounding must be one of {[r.value for r in Rounding]}, got {rounding!r}")
    if rounding == "nearest":
        return 0
    if seed is None:
        return secrets.randbits(64)
    if not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return int(seed) & ((1 << 64) - 1)


def _check_out(out, shape, dtype, like):
    """`out` as given, after checking it can take the result (None: the engine allocates)."""
    if out is None:
        return None
    if array_module(out) is not array_module(like) or out.dtype != np.dtype(dtype) or out.shape != shape:
        raise ValueError(f"out must be a {np.dtype(dtype)} array of shape {shape} on the input's device, "
                         f"got {out.dtype}{out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be contiguous")
    return out


def encode(x, fmt, rounding="nearest", seed=None, saturate=False, shift=0, out=None):
    """Codes of x * 2**shift in `fmt`: uint8 for formats of <= 8 bits, else uint16.

    x: float32 array (float16, bfloat16, float64 and integer arrays are converted to float32 first).
    rounding="stochastic" rounds up with probability equal to the discarded fraction, from a
    counter-based hash of (seed, flat index): the same seed gives the same codes on every engine.
    saturate=True clamps finite overflow to +-max; Inf and NaN stay non-finite where the format
    can say so, because hiding them would hide a diverging run. `out`: a contiguous array of the
    code dtype and x's shape to write into (hot paths reuse their buffers).
    """
    fmt = FloatFormat.parse(fmt)
    seed = _check_seed(rounding, seed)
    x, shift = _as_float32(x), _check_shift(shift)
    out = _check_out(out, x.shape, fmt.code_dtype, x)
    return engine_for(x).encode(x, fmt, shift, rounding, seed, saturate, out).astype(fmt.code_dtype, copy=False)


def _check_dtype(dtype, fmt):
    dtype = np.dtype(dtype)
    if dtype == np.float16 and fmt.fits_float16:
        return dtype
    if dtype != np.float32:
        raise ValueError(f"values come as float32, or as float16 where the grid fits it; {fmt} in {dtype} is neither")
    return dtype


def decode(codes, fmt, shift=0, dtype=np.float32, out=None):
    """Values of `codes` (as produced by encode) times 2**-shift, as float32 (or float16 where
    fmt.fits_float16 and the scaled values stay in float16's range), into `out` if given. Values
    beyond float32's range (e8mXfn reaches 2^128) come back as +-Inf."""
    fmt = FloatFormat.parse(fmt)
    codes = as_array(codes)
    if codes.dtype.kind not in "ui":
        raise TypeError(f"codes must be an unsigned integer array, got dtype {codes.dtype}")
    if codes.size and codes.dtype.itemsize * 8 > fmt.bits and int(codes.max()) >= 1 << fmt.bits:
        raise ValueError(f"codes hold values >= 2**{fmt.bits}, which {fmt} cannot have produced")
    dtype = _check_dtype(dtype, fmt)
    out = _check_out(out, codes.shape, dtype, codes)
    return engine_for(codes).decode(codes.astype(fmt.code_dtype, copy=False), fmt, _check_shift(shift), dtype, out)


def decode_sum(codes, fmt, shift=0, out=None):
    """Sum over codes' leading axis (one code buffer per rank) of decode(codes[r]) * 2**-shift, added
    in rank order in float32, into `out` (float32, added to) or a new array: decode and
    accumulate in one pass per buffer, for exchanges that carry the codes themselves."""
    fmt = FloatFormat.parse(fmt)
    codes = as_array(codes)
    if codes.ndim < 1 or codes.dtype != np.dtype(fmt.code_dtype):
        raise TypeError(f"codes must be a {fmt.code_dtype} array of shape (ranks, ...), got {codes.dtype}{codes.shape}")
    out = _check_out(out, codes.shape[1:], np.float32, codes)
    return engine_for(codes).decode_accumulate(codes, fmt, _check_shift(shift), out)


def _check_blocks(shift, block, n):
    """(one int32 exponent per block, block length) from a shift and a block length: a single
    int shift without a block (one block of all n codes), or one shift per block."""
    if block is None:
        return np.array([_check_shift(shift)], np.int32), max(1, n)
    block = _check_block(block)
    shifts = np.asarray(shift)
    if shifts.dtype.kind not in "iu" or shifts.shape != (-(-n // block),):
        raise ValueError(f"{n} codes in blocks of {block} need {-(-n // block)} integer shifts, got "
                         f"{shifts.dtype}{shifts.shape}")
    if shifts.size and not (-1000 <= shifts.min() and shifts.max() <= 1000):
        raise ValueError("shifts must lie in -1000..1000")
    return np.ascontiguousarray(shifts, np.int32), int(block)


def _check_block(block):
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return int(block)


def encode_into(x, fmt, row, start, rounding="nearest", seed=None, saturate=False, shift=0, index=0, block=None):
    """encode() and pack() in one pass: the codes of x written straight into the packed stream
    `row` (a flat uint8 array, as pack() writes) at code positions start .. start + x.size; the
    bits of every other code in the bytes they touch are kept, so pieces of a stream can be
    written one by one. index: the flat index of x[0] for stochastic rounding's hash, so a tensor
    encoded piece by piece with one seed gets the codes one encode() of it gives. block: x in
    blocks of this many elements, block k scaled by 2**shift[k]. Returns row."""
    fmt = FloatFormat.parse(fmt)
    seed = _check_seed(rounding, seed)
    x = _as_float32(x).ravel()
    shifts, block = _check_blocks(shift, block, x.size)
    row = as_array(row)
    if row.ndim != 1 or not row.flags.c_contiguous:  # a copy would take the codes and drop them
        raise TypeError(f"row must be a flat contiguous uint8 array, got {row.dtype}{row.shape}")
    _check_rows(row.reshape(1, -1), fmt, start, start + x.size)
    if not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    if array_module(row) is not array_module(x):
        raise ValueError("x and row must be on the same device")
    if x.size:
        engine_for(x).encode_into(x, fmt, shifts, block, rounding, seed, saturate, row, int(start), int(index))
    return row


def decode_sum_rows(rows, fmt, start, stop, shift=0, out=None, block=None):
    """Codes start..stop of every row of `rows` (a (ranks, bytes) uint8 array, each row a stream
    as pack() writes it; rows may lie apart, as slices of a larger buffer do) decoded, times
    2**-shift, and summed over the rows in rank order from +0.0 in float32 -> (sums, max(abs(sums)),
    +inf where a sum is NaN/Inf; with `block`, a float32 array of the max of every block of
    that many sums). One pass over the codes: no unpacked copy, no pass per rank, and the max the
    re-encode's APS shift needs comes with it."""
    fmt, rows = _check_rows(rows, fmt, start, stop)
    out = _check_out(out, (stop - start,), np.float32, rows)
    size = max(1, stop - start) if block is None else _check_block(block)
    sums, peaks = engine_for(rows).sum_rows(rows, fmt, start, stop, _check_shift(shift), size, out)
    if block is None:
        return sums, float(peaks[0]) if stop > start else 0.0
    return sums, peaks


def decode_row(row, fmt, start, stop, shift=0, out=None, divisor=1, stream=False, block=None):
    """decode() of codes start..stop of one packed stream `row`, without unpacking it first,
    divided by `divisor` in float32 (an average's N: one rounding, as decoding and then dividing
    gives, without a second pass over the values). block: codes in blocks of this many, block k
    decoded at 2**-shift[k]. stream=True: the host engine writes past the caches (results far
    larger than them, which leave them before anyone reads them anyway)."""
    fmt, rows = _check_rows(as_array(row).reshape(1, -1), fmt, start, stop)
    out = _check_out(out, (stop - start,), np.float32, rows)
    shifts, block = _check_blocks(shift, block, stop - start)
    return engine_for(rows).decode_row(rows[0], fmt, start, stop, shifts, block, out, np.float32(divisor),
                                        bool(stream))


def codes_at(row, fmt, positions):
    """The codes at `positions` (an integer array) of a packed stream, as uint32: a strided
    sample of a stream without unpacking the rest of it. Three bytes hold any code of <= 16 bits
    wherever it starts."""
    fmt, xp = FloatFormat.parse(fmt), array_module(row)
    if fmt.bits == 8:  # a byte a code
        return row[xp.asarray(positions, dtype=np.int64)].astype(np.uint32)
    bit = xp.asarray(positions, dtype=np.int64) * fmt.bits
    word = xp.zeros(bit.shape, np.uint32)
    for k in range(3):  # bytes past the stream's end only hold bits the mask drops
        word |= row[xp.minimum((bit >> 3) + k, row.size - 1)].astype(np.uint32) << np.uint32(8 * k)
    return (word >> (bit & 7).astype(np.uint32)) & np.uint32((1 << fmt.bits) - 1)


def _check_rows(rows, fmt, start, stop):
    fmt, rows = FloatFormat.parse(fmt), as_array(rows)
    if rows.ndim != 2 or rows.dtype != np.uint8 or (rows.shape[1] > 1 and rows.strides[1] != 1):
        raise TypeError(f"rows must be a (ranks, bytes) uint8 array with contiguous rows, got {rows.dtype}{rows.shape}")
    if not 0 <= start <= stop or packed_size(stop, fmt) > rows.shape[1]:
        raise ValueError(f"codes {start}..{stop} of {fmt} need {packed_size(stop, fmt)} bytes a row, "
                         f"rows have {rows.shape[1]}")
    return fmt, rows


def quantize(x, fmt, rounding="nearest", seed=None, saturate=False, shift=0, unscale=True,
             dtype=np.float32):
    """x rounded onto fmt's grid after scaling by 2**shift, and scaled back unless unscale=False.
    dtype float16 (where fmt.fits_float16) gives the grid values in half the bytes, exactly."""
    fmt = FloatFormat.parse(fmt)
    seed = _check_seed(rounding, seed)
    x, shift, dtype = _as_float32(x), _check_shift(shift), _check_dtype(dtype, fmt)
    engine = engine_for(x)
    codes = engine.encode(x, fmt, shift, rounding, seed, saturate)
    return engine.decode(codes, fmt, shift if unscale else 0, dtype)


def amax(x):
    """max(abs(x)) as a Python float, or +inf when x holds any NaN or Inf."""
    x = _as_float32(x).ravel()
    return engine_for(x).amax(x)


def amax_blocks(x, block):
    """amax() of every block of `block` elements of x (the last may be shorter), as a float32
    NumPy array."""
    x = _as_float32(x).ravel()
    return np.asarray(engine_for(x).amax_blocks(x, _check_block(block)), np.float32)


def packed_size(n, fmt):
    """Bytes that `n` codes of `fmt` take when packed."""
    return FloatFormat.parse(fmt).packed_size(n)


def pack(codes, fmt):
    """Codes as a dense little-endian bit stream: two 4-bit codes a byte, four 6-bit codes in
    three bytes, and so on. Returns a flat uint8 array of packed_size(codes.size) bytes (8-bit
    codes come back as they are, without a copy)."""
    fmt = FloatFormat.parse(fmt)
    codes = as_array(codes)
    codes = array_module(codes).ascontiguousarray(codes, dtype=fmt.code_dtype).ravel()
    if fmt.bits == 8:  # already dense: no copy
        return codes
    return engine_for(codes).pack(codes, fmt.bits)


def unpack(packed, fmt, n):
    """Inverse of pack: the first `n` codes of the packed bytes (for 8-bit formats a view)."""
    fmt = FloatFormat.parse(fmt)
    packed = as_array(packed)
    packed = array_module(packed).ascontiguousarray(packed, dtype=np.uint8).ravel()
    if packed.size < packed_size(n, fmt):
        raise ValueError(f"{n} codes of {fmt} need {packed_size(n, fmt)} bytes, got {packed.size}")
    if fmt.bits == 8:
        return packed[:n]
    return engine_for(packed).unpack(packed, fmt.bits, n, np.dtype(fmt.code_dtype))
