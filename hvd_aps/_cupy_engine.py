"""The GPU engine, codec's engine contract (its table functions): ops/kernels.cu compiled with
cupy.RawModule (once per process; CuPy caches the binary on disk), over the same per-element
functions the CPU engine is built from. Codes stay uint8/uint16: CuPy 14 has no float8 dtypes,
and none are needed.
"""
import functools
import importlib.resources
from typing import Any, Optional, Tuple, Union

import cupy
import numpy as np

from . import _device
from ._engine import Array
from ._tables import SAMPLE_SUMS, Blocks
from .config import Rounding
from .formats import FloatFormat

_THREADS = 256
_MAX_BLOCKS = 1 << 16  # a grid-stride loop's blocks: the rest of its elements loop


@functools.lru_cache(maxsize=None)
def _module() -> "cupy.RawModule":
    # as_file: a real path for NVRTC's -I, however the package was installed (str() of a
    # namespace or editable package's resource root is no directory name)
    with importlib.resources.as_file(importlib.resources.files("hvd_aps.ops") / "kernels.cu") as source:
        return cupy.RawModule(code=source.read_text(), options=("-std=c++17", f"-I{source.parent}"))


def _fmt_args(fmt: FloatFormat) -> Tuple[np.int32, np.int32, np.int32]:
    return np.int32(fmt.exp_bits), np.int32(fmt.man_bits), np.int32(fmt.policy)


# Block tables (hvd_aps._tables): one launch per stage, one thread block per table row, on the
# current stream; what they return stays on the device -----------------------------------------
def _rows(blocks: Blocks, like: Array) -> Array:
    """A table's rows on the current device, copied there once per table (tables are kept per layout)."""
    return _device.on_device(blocks.rows, like)


def _launch_rows(name: str, blocks: Blocks, *args: Any) -> None:
    _module().get_function(name)((blocks.count,), (_THREADS,), args)


def _launch(name: str, n: int, *args: Any) -> None:
    """A grid-stride kernel over n elements."""
    _module().get_function(name)((max(1, min(-(-n // _THREADS), _MAX_BLOCKS)),), (_THREADS,), args)


def _peaks(bits: Array) -> Array:
    """float32 maxima from a kernel's max of |x| bits, on the device: +inf for any NaN/Inf."""
    return cupy.where(bits >= 0x7F800000, cupy.float32(np.inf), bits.view(cupy.float32))


def table_amax(x: Array, blocks: Blocks) -> Array:
    peaks = cupy.zeros(blocks.count, cupy.uint32)
    if blocks.count:
        _launch_rows("hvd_table_amax", blocks, x, _rows(blocks, x), peaks)
    return _peaks(peaks)


def table_encode(x: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, rounding: Union[Rounding, str],
                 seeds: Optional[Array], saturate: bool, message: Array, residual: Optional[Array] = None) -> Array:
    if blocks.count:
        stochastic = Rounding(rounding) is Rounding.STOCHASTIC
        _launch_rows("hvd_table_encode", blocks, x, _rows(blocks, x), message, *_fmt_args(fmt), np.int32(saturate),
                     cupy.asarray(shifts, cupy.int32), np.int32(stochastic),
                     cupy.asarray(seeds, cupy.uint64) if stochastic else cupy.zeros(1, cupy.uint64),
                     residual if residual is not None else np.uint64(0))
    return message


def table_sum(rows: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, out: Array) -> Array:
    peaks = cupy.zeros(blocks.count, cupy.uint32)
    if blocks.count:
        _launch_rows("hvd_table_sum", blocks, rows, np.int64(rows.strides[0]), np.int32(rows.shape[0]),
                     _rows(blocks, rows), out, *_fmt_args(fmt), cupy.asarray(shifts, cupy.int32), peaks)
    return _peaks(peaks)


def table_decode(message: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, out: Array,
                 divisor: np.float32 = np.float32(1), stream: bool = False) -> Array:
    if blocks.count:
        _launch_rows("hvd_table_decode", blocks, message, _rows(blocks, message), out, *_fmt_args(fmt),
                     cupy.asarray(shifts, cupy.int32), np.float32(divisor))
    return out


def table_shifts(peaks: Array, limit: float, exponents: Array) -> Array:
    shifts = cupy.empty(peaks.size, cupy.int32)
    if peaks.size:
        _launch("hvd_table_shifts", peaks.size, peaks, np.int64(peaks.size), np.float64(limit), shifts, exponents)
    return shifts


def table_stats(x: Array, message: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, first: Array,
                step: Array, limits: Array) -> Array:
    sums = cupy.zeros((blocks.count, SAMPLE_SUMS), cupy.float64)
    if blocks.count:
        _launch_rows("hvd_table_stats", blocks, x, message, _rows(blocks, x), cupy.asarray(first, cupy.int64),
                     cupy.asarray(step, cupy.int64), *_fmt_args(fmt), cupy.asarray(shifts, cupy.int32),
                     cupy.asarray(limits, cupy.float32), sums)
    return sums
