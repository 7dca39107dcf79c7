"""The GPU engine: ops/kernels.cu compiled with cupy.RawModule (once per process; CuPy caches the
binary on disk), over the same per-element functions the CPU engine is built from. Codes stay
uint8/uint16: CuPy 14 has no float8 dtypes, and none are needed.
"""
import functools
import importlib.resources

import cupy
import numpy as np

_THREADS = 256
_MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest


@functools.lru_cache(maxsize=None)
def _module():
    ops = importlib.resources.files("hvd_aps.ops")
    return cupy.RawModule(code=(ops / "kernels.cu").read_text(), options=("-std=c++17", f"-I{ops}"))


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


def decode_accumulate(codes, fmt, shift, out=None, accumulate=True):
    """out (+)= the float32 sum over codes' leading axis (one buffer per rank) of decode * 2^-shift."""
    codes = cupy.ascontiguousarray(codes, dtype=fmt.code_dtype)
    ranks, n = (1, codes.size) if codes.ndim < 2 else (codes.shape[0], codes[0].size)
    accumulate = accumulate and out is not None
    out = cupy.empty(codes.shape[1:] if codes.ndim >= 2 else codes.shape, cupy.float32) if out is None else out
    name = "hvd_decode_u8" if codes.itemsize == 1 else "hvd_decode_u16"
    _launch(name, n, codes, out, np.int64(n), np.int32(ranks), np.int32(accumulate), *_fmt_args(fmt), np.int32(shift))
    return out


def decode(codes, fmt, shift, dtype, out=None):
    stacked = cupy.ascontiguousarray(codes).reshape((1,) + codes.shape)
    if dtype == np.float32:
        return decode_accumulate(stacked, fmt, shift, out, accumulate=False)
    values = decode_accumulate(stacked, fmt, shift).astype(dtype)
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
    bits = int(result.get()[0])
    return float("inf") if bits >= 0x7F800000 else float(np.array(bits, np.uint32).view(np.float32))
