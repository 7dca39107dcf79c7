"""The GPU engine: ops/kernels.cu compiled with cupy.RawModule (once per process; CuPy caches the
binary on disk), over the same per-element functions the CPU engine is built from. Codes stay
uint8/uint16: CuPy 14 has no float8 dtypes, and none are needed.
"""
import functools
import importlib.resources

import cupy
import numpy as np

from . import _device
from ._tables import SAMPLE_SUMS
from .codec import packed_size

_THREADS = 256
_MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest


@functools.lru_cache(maxsize=None)
def _module():
    # as_file: a real path for NVRTC's -I, however the package was installed (str() of a
    # namespace or editable package's resource root is no directory name)
    with importlib.resources.as_file(importlib.resources.files("hvd_aps.ops") / "kernels.cu") as source:
        return cupy.RawModule(code=source.read_text(), options=("-std=c++17", f"-I{source.parent}"))


def _launch(name, n, *args):
    blocks = max(1, min(-(-n // _THREADS), _MAX_BLOCKS))
    _module().get_function(name)((blocks,), (_THREADS,), args)


def _fmt_args(fmt):
    return np.int32(fmt.exp_bits), np.int32(fmt.man_bits), np.int32(fmt.policy)


def encode(x, fmt, shift, rounding, seed, saturate, out=None):
    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    out = cupy.empty(x.shape, dtype=fmt.code_dtype) if out is None else out
    name = "hvd_encode_u8" if out.itemsize == 1 else "hvd_encode_u16"
    _launch(name, max(1, x.size // 4), x, out, np.int64(x.size), *_fmt_args(fmt), np.int32(saturate),
            np.int32(shift), np.int32(rounding == "stochastic"), np.uint64(seed), np.int32(x.data.ptr % 16 == 0))
    return out


def encode_into(x, fmt, shifts, block, rounding, seed, saturate, row, pos, index):
    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    touched = packed_size(x.size, fmt) + 1  # the bytes x.size codes reach, wherever they start
    _launch("hvd_encode_row", touched, x, np.int64(x.size), np.int64(index), row, np.int64(pos),
            *_fmt_args(fmt), np.int32(saturate), cupy.asarray(shifts, cupy.int32), np.int64(block),
            np.int32(rounding == "stochastic"), np.uint64(seed))
    return row


def sum_rows(rows, fmt, start, stop, shift, block, out=None):
    out = cupy.empty(stop - start, cupy.float32) if out is None else out
    peaks = cupy.zeros(max(1, -(-(stop - start) // block)), cupy.uint32)
    _launch("hvd_sum_rows", max(1, stop - start), rows, np.int64(rows.strides[0]), np.int32(rows.shape[0]),
            np.int64(start), np.int64(stop - start), out, *_fmt_args(fmt), np.int32(shift), np.int64(block), peaks)
    return out, _amax_from_bits(peaks)


def decode_row(row, fmt, start, stop, shifts, block, out=None, divisor=np.float32(1), stream=False):
    out = cupy.empty(stop - start, cupy.float32) if out is None else out
    _launch("hvd_decode_row", max(1, stop - start), row, np.int64(start), np.int64(stop - start), out,
            *_fmt_args(fmt), cupy.asarray(shifts, cupy.int32), np.int64(block), np.float32(divisor))
    return out


def amax_blocks(x, block):
    x = cupy.ascontiguousarray(x, dtype=cupy.float32).ravel()
    peaks = cupy.zeros(-(-x.size // block), cupy.uint32)
    _launch("hvd_amax_blocks", x.size, x, np.int64(x.size), np.int64(block), peaks)
    return _amax_from_bits(peaks)


def _decode_into(codes, fmt, shift, out, accumulate):
    """out (+)= the float32 sum over codes' leading axis (one buffer per rank) of decode * 2^-shift."""
    codes = cupy.ascontiguousarray(codes, dtype=fmt.code_dtype)
    ranks, n = codes.shape[0], codes[0].size
    name = "hvd_decode_u8" if codes.itemsize == 1 else "hvd_decode_u16"
    _launch(name, n, codes, out, np.int64(n), np.int32(ranks), np.int32(accumulate), *_fmt_args(fmt), np.int32(shift))
    return out


def decode_accumulate(codes, fmt, shift, out=None):
    """A fresh sum starts from +0.0 in rank order, as the CPU engines add."""
    return _decode_into(codes, fmt, shift, cupy.zeros(codes.shape[1:], cupy.float32) if out is None else out, True)


def decode(codes, fmt, shift, dtype, out=None):
    stacked = cupy.ascontiguousarray(codes).reshape((1,) + codes.shape)
    if dtype == np.float32:
        return _decode_into(stacked, fmt, shift, cupy.empty(codes.shape, cupy.float32) if out is None else out, False)
    values = _decode_into(stacked, fmt, shift, cupy.empty(codes.shape, cupy.float32), False).astype(dtype)
    if out is None:
        return values
    out[...] = values
    return out


def pack(codes, bits):
    out = cupy.empty(-(-codes.size * bits // 8), cupy.uint8)
    name = "hvd_pack_u8" if codes.itemsize == 1 else "hvd_pack_u16"
    _launch(name, out.size, codes, np.int64(codes.size), np.int32(bits), out, np.int64(out.size))
    return out


def unpack(packed, bits, n, dtype):
    out = cupy.empty(n, dtype)
    _launch("hvd_unpack_u8" if dtype.itemsize == 1 else "hvd_unpack_u16", n, packed, np.int32(bits), out, np.int64(n))
    return out


def amax(x):
    x = cupy.ascontiguousarray(x, dtype=cupy.float32).ravel()
    result = cupy.zeros(1, cupy.uint32)
    _launch("hvd_amax_bits", x.size, x, np.int64(x.size), result)
    return float(_amax_from_bits(result)[0])


def _amax_from_bits(result):
    """The host's float32 maxima from a kernel's max of |x| bits: +inf for any NaN/Inf."""
    bits = result.get()
    return np.where(bits >= 0x7F800000, np.float32(np.inf), bits.view(np.float32)).astype(np.float32)


# Block tables (hvd_aps._tables): one launch per stage, one thread block per table row, on the
# current stream; what they return stays on the device -----------------------------------------
def _rows(blocks, like):
    """A table's rows on the current device, copied once per table (tables are made once per layout)."""
    return _device.on_device(blocks.rows, like)


def _launch_rows(name, blocks, *args):
    _module().get_function(name)((blocks.count,), (_THREADS,), args)


def _peaks(bits):
    """float32 maxima from a kernel's max of |x| bits, on the device: +inf for any NaN/Inf."""
    return cupy.where(bits >= 0x7F800000, cupy.float32(np.inf), bits.view(cupy.float32))


def table_amax(x, blocks):
    peaks = cupy.zeros(blocks.count, cupy.uint32)
    if blocks.count:
        _launch_rows("hvd_table_amax", blocks, x, _rows(blocks, x), peaks)
    return _peaks(peaks)


def table_encode(x, fmt, blocks, shifts, rounding, seeds, saturate, message, residual=None):
    if blocks.count:
        stochastic = rounding == "stochastic"
        _launch_rows("hvd_table_encode", blocks, x, _rows(blocks, x), message, *_fmt_args(fmt), np.int32(saturate),
                     cupy.asarray(shifts, cupy.int32), np.int32(stochastic),
                     cupy.asarray(seeds, cupy.uint64) if stochastic else cupy.zeros(1, cupy.uint64),
                     residual if residual is not None else np.uint64(0))
    return message


def table_sum(rows, fmt, blocks, shifts, out):
    peaks = cupy.zeros(blocks.count, cupy.uint32)
    if blocks.count:
        _launch_rows("hvd_table_sum", blocks, rows, np.int64(rows.strides[0]), np.int32(rows.shape[0]),
                     _rows(blocks, rows), out, *_fmt_args(fmt), cupy.asarray(shifts, cupy.int32), peaks)
    return _peaks(peaks)


def table_decode(message, fmt, blocks, shifts, out, divisor=np.float32(1), stream=False):
    if blocks.count:
        _launch_rows("hvd_table_decode", blocks, message, _rows(blocks, message), out, *_fmt_args(fmt),
                     cupy.asarray(shifts, cupy.int32), np.float32(divisor))
    return out


def table_shifts(peaks, limit, exponents):
    shifts = cupy.empty(peaks.size, cupy.int32)
    if peaks.size:
        _launch("hvd_aps_shifts", peaks.size, peaks, np.int64(peaks.size), np.float64(limit), shifts, exponents)
    return shifts


def table_stats(x, message, fmt, blocks, shifts, first, step, limits):
    sums = cupy.zeros((blocks.count, SAMPLE_SUMS), cupy.float64)
    if blocks.count:
        _launch_rows("hvd_table_stats", blocks, x, message, _rows(blocks, x), cupy.asarray(first, cupy.int64),
                     cupy.asarray(step, cupy.int64), *_fmt_args(fmt), cupy.asarray(shifts, cupy.int32),
                     cupy.asarray(limits, cupy.float32), sums)
    return sums
