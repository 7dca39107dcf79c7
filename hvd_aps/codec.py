"""encode / decode / quantize between float32 and a FloatFormat's codes, plus sub-byte packing.

Arrays on a CUDA device (CuPy arrays, CUDA torch tensors, anything exporting DLPack from one) go
zero-copy to the CuPy engine and come back as CuPy arrays; the rest go through NumPy and the
compiled CPU engine. Every engine gives the same bits: round to nearest, ties to the even code
(with man_bits=0 "even" is the exponent's last bit), gradual underflow, signed zero, and NaN, Inf
and overflow exactly as ml_dtypes' `astype` treats them. The APS `shift` multiplies by 2**shift
inside the conversion (decode by 2**-shift), so scaling never rounds on its own.

Blocked runs (encode_into, decode_sum_rows, decode_row take `block`) give each block its own
exponent or max, so the codes exchange's numbers do not depend on how buckets are cut. Each
function is mostly one call of the engine contract (hvd_aps._engine.Engine: _host_engine,
_numpy_engine, _cupy_engine) over a run's table (hvd_aps._tables.run); widths other than 8 and 16
bits are packed and unpacked here with array operations (pack, unpack), alike on every engine.
"""
import functools
import math
import os
import secrets
import warnings
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from . import _host_engine, _numpy_engine, _tables
from ._arrays import array_module, as_array, to_numpy
from ._choice import Choice
from ._engine import Array, Engine
from ._tables import Blocks
from .config import Rounding
from .formats import FloatFormat, fp16

_INPUT_KINDS = "fiub"  # float, signed, unsigned, bool: numbers NumPy converts exactly or by rounding
# How wide the CPU engine's calls run (the other engines have no threads of their own): one
# thread for exchanges beside the step's compute, every thread while the step waits for them
beside_compute, awaited = _host_engine.beside_compute, _host_engine.awaited
# What the functions here take: a format or its name (FloatFormat.parse); a Python or NumPy
# integer; one shift, or one per block; a rounding by its Rounding or its name
_Format = Union[FloatFormat, str]
_Int = Union[int, np.integer]
_Shifts = Union[int, np.integer, np.ndarray, Sequence[int]]
_Rounding = Union[Rounding, str]


def engine_for(a: Array) -> Engine:
    """The engine for arrays like `a`: the CuPy engine on a CUDA device, else the CPU's. The
    exchange's stages call its table functions directly, their arguments checked once per
    bucket layout (hvd_aps._tables) rather than per call."""
    if array_module(a) is not np:
        from . import _cupy_engine
        return _cupy_engine
    return _engine()


class EngineChoice(Choice):
    """HVD_APS_ENGINE: the CPU's engine."""
    AUTO = "auto"    # the compiled host engine, else NumPy's with a warning
    HOST = "host"    # the compiled host engine, or an error
    NUMPY = "numpy"  # NumPy's


def _engine() -> Engine:
    choice = EngineChoice.parse(os.environ.get("HVD_APS_ENGINE", EngineChoice.AUTO.value), "HVD_APS_ENGINE")
    if choice is EngineChoice.NUMPY:
        return _numpy_engine
    if choice is EngineChoice.AUTO and not _host_engine.available:
        _warn_numpy_fallback()
        return _numpy_engine
    if not _host_engine.available:
        raise RuntimeError("HVD_APS_ENGINE=host but the compiled engine is not built; "
                           "reinstall hvd_aps with a C compiler present")
    return _host_engine


@functools.lru_cache(maxsize=None)
def _warn_numpy_fallback() -> None:
    """Once per process: a source tree without the built host engine runs, but slower."""
    warnings.warn("hvd_aps: the compiled host engine (ops/host.c) is not built, so the NumPy engine "
                  "runs instead, about 2.5x slower; build it with `pip install -e .` where a C compiler "
                  "is present (HVD_APS_ENGINE=numpy picks NumPy on purpose and silences this)",
                  RuntimeWarning, stacklevel=4)


def engine_name() -> str:
    """Which engine NumPy inputs use: "host" (compiled ops/host.c) or "numpy"."""
    return "host" if _engine() is _host_engine else "numpy"


def _as_float32(x: Array) -> Array:
    x = as_array(x)
    if x.dtype.kind not in _INPUT_KINDS and x.dtype.name != "bfloat16":
        raise TypeError(f"expected a numeric array, got dtype {x.dtype}")
    return array_module(x).ascontiguousarray(x, dtype=np.float32)


def _check_shift(shift: _Int) -> int:
    if not isinstance(shift, (int, np.integer)) or not -1000 <= shift <= 1000:
        raise ValueError(f"shift must be an int in -1000..1000, got {shift!r}")
    return int(shift)


def _check_seed(rounding: _Rounding, seed: Optional[_Int]) -> int:
    if rounding not in [r.value for r in Rounding]:
        raise ValueError(f"rounding must be one of {[r.value for r in Rounding]}, got {rounding!r}")
    if Rounding(rounding) is Rounding.NEAREST:
        return 0
    if seed is None:
        return secrets.randbits(64)
    if not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return int(seed) & ((1 << 64) - 1)


def _check_out(out: Optional[Array], shape: Tuple[int, ...], dtype: npt.DTypeLike, like: Array) -> Optional[Array]:
    """`out` as given, after checking it can take the result (None: a new array takes it)."""
    if out is None:
        return None
    if array_module(out) is not array_module(like) or out.dtype != np.dtype(dtype) or out.shape != shape:
        raise ValueError(f"out must be a {np.dtype(dtype)} array of shape {shape} on the input's device, "
                         f"got {out.dtype}{out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be contiguous")
    return out


def _whole_bytes(fmt: FloatFormat) -> bool:
    """Whether fmt's codes fill whole bytes (8 and 16 bits): its packed stream is then the array
    of its codes, byte for byte (16-bit codes low byte first, as little-endian machines hold them)."""
    return fmt.bits % 8 == 0


def _shifts(table: Blocks, shifts: Union[int, np.ndarray]) -> np.ndarray:
    """Each table row's exponent (int32, as engines take them): one int for the whole run, or
    one per block of it."""
    if isinstance(shifts, int):
        return np.full(table.count, shifts, np.int32)
    return np.ascontiguousarray(shifts[table.tensor], np.int32)


def _seeds(table: Blocks, rounding: _Rounding, seed: int) -> Optional[np.ndarray]:
    """Each row's seed: the run's one seed (None for rounding to nearest, which draws none)."""
    return np.full(table.count, seed, np.uint64) if Rounding(rounding) is Rounding.STOCHASTIC else None


def _encode_stream(x: Array, fmt: FloatFormat, shift: int, rounding: _Rounding, seed: int, saturate: bool,
                   message: Array) -> Array:
    """The codes of flat x at 2**shift into the packed stream `message` (one engine call)."""
    table = _tables.run(x.size, max(1, x.size))
    return engine_for(x).table_encode(x, fmt, table, _shifts(table, shift), rounding, _seeds(table, rounding, seed),
                                      saturate, message)


def _decode_stream(message: Array, fmt: FloatFormat, shift: int, out: Array) -> Array:
    """The float32 values of the out.size codes of a packed stream at 2**-shift into flat `out`."""
    table = _tables.run(out.size, max(1, out.size))
    return engine_for(message).table_decode(message, fmt, table, _shifts(table, shift), out, np.float32(1), False)


def encode(x: Array, fmt: _Format, rounding: _Rounding = "nearest", seed: Optional[_Int] = None, saturate: bool = False,
           shift: _Int = 0, out: Optional[Array] = None) -> Array:
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
    xp = array_module(x)
    if _whole_bytes(fmt):
        out = xp.empty(x.shape, fmt.code_dtype) if out is None else out
        _encode_stream(x.reshape(-1), fmt, shift, rounding, seed, saturate, out.reshape(-1).view(np.uint8))
        return out
    message = xp.empty(fmt.packed_size(x.size), np.uint8)
    codes = _unpack_bits(_encode_stream(x.reshape(-1), fmt, shift, rounding, seed, saturate, message), fmt.bits,
                         x.size, np.dtype(fmt.code_dtype)).reshape(x.shape)
    if out is None:
        return codes
    out[...] = codes
    return out


def _check_dtype(dtype: npt.DTypeLike, fmt: FloatFormat) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype == np.float16 and fmt.fits_float16:
        return dtype
    if dtype != np.float32:
        raise ValueError(f"values come as float32, or as float16 where the grid fits it; {fmt} in {dtype} is neither")
    return dtype


def _streams(codes: Array, fmt: FloatFormat) -> Array:
    """codes (contiguous, of fmt's code dtype) as packed streams along their last axis."""
    if _whole_bytes(fmt):
        return codes.view(np.uint8)
    return _pack_bits(codes, fmt.bits)


def _in_dtype(values: Array, dtype: np.dtype, out: Optional[Array]) -> Array:
    """float32 values as `dtype`, into `out` where given: float16 values are fp16's codes, which
    every engine encodes bit for bit as NumPy casts float32 to float16 (the oracle tests hold
    it to ml_dtypes), in one engine call where NumPy's cast takes several times as long."""
    if dtype == np.float32:
        return values
    out = array_module(values).empty(values.shape, np.float16) if out is None else out
    _encode_stream(values.reshape(-1), fp16, 0, "nearest", 0, False, out.reshape(-1).view(np.uint8))
    return out


def decode(codes: Array, fmt: _Format, shift: _Int = 0, dtype: npt.DTypeLike = np.float32,
           out: Optional[Array] = None) -> Array:
    """Values of `codes` (as produced by encode) times 2**-shift, as float32 (or float16 where
    fmt.fits_float16 and the scaled values stay in float16's range), into `out` if given. Values
    beyond float32's range (e8mXfn reaches 2^128) come back as +-Inf."""
    fmt = FloatFormat.parse(fmt)
    codes = as_array(codes)
    if codes.dtype.kind not in "ui":
        raise TypeError(f"codes must be an unsigned integer array, got dtype {codes.dtype}")
    if codes.size and codes.dtype.itemsize * 8 > fmt.bits and int(codes.max()) >= 1 << fmt.bits:
        raise ValueError(f"codes hold values >= 2**{fmt.bits}, which {fmt} cannot have produced")
    dtype, shift = _check_dtype(dtype, fmt), _check_shift(shift)
    out = _check_out(out, codes.shape, dtype, codes)
    xp = array_module(codes)
    codes = xp.ascontiguousarray(codes, dtype=fmt.code_dtype)
    values = out if out is not None and dtype == np.float32 else xp.empty(codes.shape, np.float32)
    _decode_stream(_streams(codes.reshape(-1), fmt), fmt, shift, values.reshape(-1))
    return _in_dtype(values, dtype, out)


def decode_sum(codes: Array, fmt: _Format, shift: _Int = 0, out: Optional[Array] = None) -> Array:
    """Sum over codes' leading axis (one code buffer per rank) of decode(codes[r]) * 2**-shift, added
    in rank order in float32, into `out` (float32, added to) or a new array: a new sum (from +0.0)
    is one pass over the ranks' codes, for exchanges that carry the codes themselves."""
    fmt, shift = FloatFormat.parse(fmt), _check_shift(shift)
    codes = as_array(codes)
    if codes.ndim < 1 or codes.dtype != np.dtype(fmt.code_dtype):
        raise TypeError(f"codes must be a {fmt.code_dtype} array of shape (ranks, ...), got {codes.dtype}{codes.shape}")
    out = _check_out(out, codes.shape[1:], np.float32, codes)
    xp, n = array_module(codes), math.prod(codes.shape[1:])
    rows = _streams(xp.ascontiguousarray(codes).reshape(codes.shape[0], n), fmt)
    if out is None:
        out = xp.empty(codes.shape[1:], np.float32)
        table = _tables.run(n, max(1, n))
        engine_for(rows).table_sum(rows, fmt, table, _shifts(table, shift), out.reshape(-1))
        return out
    flat, values = out.reshape(-1), xp.empty(n, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf sums, silent as the engines' are
        for row in rows:  # added to what `out` holds a rank at a time, each addition rounded as it goes
            flat += _decode_stream(row, fmt, shift, values)
    return out


def _check_blocks(shift: _Shifts, block: Optional[_Int], n: int) -> Tuple[np.ndarray, int]:
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


def _check_block(block: _Int) -> int:
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return int(block)


def encode_into(x: Array, fmt: _Format, row: Array, start: int, rounding: _Rounding = "nearest",
                seed: Optional[_Int] = None, saturate: bool = False, shift: _Shifts = 0, index: _Int = 0,
                block: Optional[_Int] = None) -> Array:
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
        table = _tables.run(x.size, block, int(start), int(index))
        engine_for(x).table_encode(x, fmt, table, _shifts(table, shifts), rounding, _seeds(table, rounding, seed),
                                   saturate, row)
    return row


def decode_sum_rows(rows: Array, fmt: _Format, start: int, stop: int, shift: _Int = 0, out: Optional[Array] = None,
                    block: Optional[_Int] = None) -> Tuple[Array, Union[float, np.ndarray]]:
    """Codes start..stop of every row of `rows` (a (ranks, bytes) uint8 array, each row a stream
    as pack() writes it; rows may lie apart, as slices of a larger buffer do) decoded, times
    2**-shift, and summed over the rows in rank order from +0.0 in float32 -> (sums, max(abs(sums)),
    +inf where a sum is NaN/Inf; with `block`, a float32 array of the max of every block of
    that many sums). One pass over the codes: no unpacked copy, no pass per rank, and the max the
    re-encode's APS shift needs comes with it."""
    fmt, rows = _check_rows(rows, fmt, start, stop)
    out = _check_out(out, (stop - start,), np.float32, rows)
    out = array_module(rows).empty(stop - start, np.float32) if out is None else out
    size = max(1, stop - start) if block is None else _check_block(block)
    table = _tables.run(stop - start, size, start)
    peaks = engine_for(rows).table_sum(rows, fmt, table, _shifts(table, _check_shift(shift)), out)
    if block is None:
        return out, float(_block_max(peaks, table, 1)[0])
    return out, _block_max(peaks, table, max(1, -(-(stop - start) // size)))  # no codes: one block's 0


def _block_max(peaks: Array, table: Blocks, blocks: int) -> np.ndarray:
    """The max of every block's rows' peaks (float32; 0 for a block of no rows)."""
    out = np.zeros(blocks, np.float32)
    np.maximum.at(out, table.tensor, to_numpy(peaks))
    return out


def decode_row(row: Array, fmt: _Format, start: int, stop: int, shift: _Shifts = 0, out: Optional[Array] = None,
               divisor: float = 1, stream: bool = False, block: Optional[_Int] = None) -> Array:
    """decode() of codes start..stop of one packed stream `row`, without unpacking it first,
    divided by `divisor` in float32 (an average's N: one rounding, as decoding and then dividing
    gives, without a second pass over the values). block: codes in blocks of this many, block k
    decoded at 2**-shift[k]. stream=True: the host engine writes past the caches (results far
    larger than them, which leave them before anyone reads them anyway)."""
    fmt, rows = _check_rows(as_array(row).reshape(1, -1), fmt, start, stop)
    out = _check_out(out, (stop - start,), np.float32, rows)
    out = array_module(rows).empty(stop - start, np.float32) if out is None else out
    shifts, block = _check_blocks(shift, block, stop - start)
    table = _tables.run(stop - start, block, start)
    return engine_for(rows).table_decode(rows[0], fmt, table, _shifts(table, shifts), out, np.float32(divisor),
                                         bool(stream))


def codes_at(row: Array, fmt: _Format, positions: Array) -> Array:
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


def _check_rows(rows: Array, fmt: _Format, start: int, stop: int) -> Tuple[FloatFormat, Array]:
    fmt, rows = FloatFormat.parse(fmt), as_array(rows)
    if rows.ndim != 2 or rows.dtype != np.uint8 or (rows.shape[1] > 1 and rows.strides[1] != 1):
        raise TypeError(f"rows must be a (ranks, bytes) uint8 array with contiguous rows, got {rows.dtype}{rows.shape}")
    if not 0 <= start <= stop or packed_size(stop, fmt) > rows.shape[1]:
        raise ValueError(f"codes {start}..{stop} of {fmt} need {packed_size(stop, fmt)} bytes a row, "
                         f"rows have {rows.shape[1]}")
    return fmt, rows


def quantize(x: Array, fmt: _Format, rounding: _Rounding = "nearest", seed: Optional[_Int] = None,
             saturate: bool = False, shift: _Int = 0, unscale: bool = True, dtype: npt.DTypeLike = np.float32) -> Array:
    """x rounded onto fmt's grid after scaling by 2**shift, and scaled back unless unscale=False.
    dtype float16 (where fmt.fits_float16) gives the grid values in half the bytes, exactly."""
    fmt = FloatFormat.parse(fmt)
    seed = _check_seed(rounding, seed)
    x, shift, dtype = _as_float32(x), _check_shift(shift), _check_dtype(dtype, fmt)
    xp = array_module(x)
    message = xp.empty(fmt.packed_size(x.size), np.uint8)
    _encode_stream(x.reshape(-1), fmt, shift, rounding, seed, saturate, message)
    values = xp.empty(x.shape, np.float32)
    _decode_stream(message, fmt, shift if unscale else 0, values.reshape(-1))
    return _in_dtype(values, dtype, None)


def amax(x: Array) -> float:
    """max(abs(x)) as a Python float, or +inf when x holds any NaN or Inf."""
    x = _as_float32(x).ravel()
    table = _tables.run(x.size, max(1, x.size))
    return float(_block_max(engine_for(x).table_amax(x, table), table, 1)[0])


def amax_blocks(x: Array, block: _Int) -> np.ndarray:
    """amax() of every block of `block` elements of x (the last may be shorter), as a float32
    NumPy array."""
    x, block = _as_float32(x).ravel(), _check_block(block)
    table = _tables.run(x.size, block)
    return _block_max(engine_for(x).table_amax(x, table), table, -(-x.size // block))


def packed_size(n: int, fmt: _Format) -> int:
    """Bytes that `n` codes of `fmt` take when packed."""
    return FloatFormat.parse(fmt).packed_size(n)


def pack(codes: Array, fmt: _Format) -> Array:
    """Codes as a dense little-endian bit stream: two 4-bit codes a byte, four 6-bit codes in
    three bytes, and so on. Returns a flat uint8 array of packed_size(codes.size) bytes (8-bit
    codes come back as they are, without a copy)."""
    fmt = FloatFormat.parse(fmt)
    codes = as_array(codes)
    codes = array_module(codes).ascontiguousarray(codes, dtype=fmt.code_dtype).ravel()
    if fmt.bits == 8:  # already dense: no copy
        return codes
    return _pack_bits(codes, fmt.bits)


def unpack(packed: Array, fmt: _Format, n: int) -> Array:
    """Inverse of pack: the first `n` codes of the packed bytes (for 8-bit formats a view)."""
    fmt = FloatFormat.parse(fmt)
    packed = as_array(packed)
    packed = array_module(packed).ascontiguousarray(packed, dtype=np.uint8).ravel()
    if packed.size < packed_size(n, fmt):
        raise ValueError(f"{n} codes of {fmt} need {packed_size(n, fmt)} bytes, got {packed.size}")
    if fmt.bits == 8:
        return packed[:n]
    return _unpack_bits(packed, fmt.bits, n, np.dtype(fmt.code_dtype))


def _group(bits: int) -> Tuple[int, int]:
    """(codes, bytes): the fewest codes of `bits` bits that fill whole bytes, and those bytes.
    Code k of every group starts at the same bit of its group (k * bits), so packing loops over
    the few codes of a group, each over every group at once."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def _cut_or_padded(a: Array, size: int) -> Array:
    """The first `size` elements of a's last axis, zeros after its end."""
    if a.shape[-1] >= size:
        return a[..., :size]
    out = array_module(a).zeros(a.shape[:-1] + (size,), a.dtype)
    out[..., :a.shape[-1]] = a
    return out


def _pack_bits(codes: Array, bits: int) -> Array:
    """The codes along codes' last axis as packed streams (pack()), a group at a time: byte j
    of a group is the OR of the parts of the codes that overlap it."""
    per, size = _group(bits)
    lead, n = codes.shape[:-1], codes.shape[-1]
    groups = -(-n // per)
    grouped = _cut_or_padded(codes, groups * per).reshape(lead + (groups, per))
    out = array_module(codes).empty(lead + (groups, size), np.uint8)
    scalar = grouped.dtype.type  # shifts by scalars of the codes' own type keep that type
    for j in range(size):
        byte = 0
        for k in range(8 * j // bits, min(per - 1, (8 * j + 7) // bits) + 1):
            at = k * bits - 8 * j  # where code k starts, from byte j's first bit
            byte = byte | (grouped[..., k] << scalar(at) if at >= 0 else grouped[..., k] >> scalar(-at))
        out[..., j] = byte  # the high bits of a wider part fall away: each belongs to another byte
    return out.reshape(lead + (groups * size,))[..., :-(-n * bits // 8)]


# The unsigned type that holds 1, 2 or 3 bytes of a stream: the narrowest, for the fewest bytes moved
_SPANS = {1: np.uint8, 2: np.uint16, 3: np.uint32}


def _unpack_bits(packed: Array, bits: int, n: int, dtype: np.dtype) -> Array:
    """The first n codes of a flat packed stream (unpack()), a group at a time: code k of a
    group is read from the (at most three) bytes it overlaps."""
    per, size = _group(bits)
    groups = -(-n // per)
    grouped = _cut_or_padded(packed, groups * size).reshape(groups, size)
    out = array_module(packed).empty((groups, per), dtype)
    for k in range(per):
        first, at = divmod(k * bits, 8)
        count = (k * bits + bits - 1) // 8 - first + 1  # bytes code k overlaps
        span = _SPANS[count]
        word = grouped[:, first].astype(span, copy=False)
        for j in range(1, count):
            word = word | grouped[:, first + j].astype(span) << span(8 * j)
        out[:, k] = (word >> span(at)) & span((1 << bits) - 1)
    return out.reshape(-1)[:n]
