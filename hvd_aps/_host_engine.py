"""The compiled CPU engine: ops/host.c built into hvd_aps/_hostcodec*.so by setup.py, driven
through ctypes; codec's engine contract, its table functions, and nothing else of the codec. A
large table is cut into one share of its blocks per core, run in a thread pool; ctypes releases
the GIL during each call, so the shares really run in parallel.
"""
import contextlib
import ctypes
import functools
import importlib.machinery
import math
import os
import pathlib
import threading
from typing import Any, Callable, Iterator, List, Optional, Union

import numpy as np

from . import _numpy_engine
from ._tables import SAMPLE_SUMS, Blocks
from ._threads import pool as named_pool
from .config import Rounding
from .formats import FloatFormat

_MIN_CHUNK = 1 << 18  # below this, thread hand-off costs more than it saves


class _Fmt(ctypes.Structure):
    _fields_ = [("exp_bits", ctypes.c_int32), ("man_bits", ctypes.c_int32),
                ("policy", ctypes.c_int32), ("saturate", ctypes.c_int32)]


def _find_library() -> Optional[pathlib.Path]:
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_hostcodec{suffix}"
        if path.exists():
            return path
    return None


def _load() -> Optional[ctypes.CDLL]:
    path = _find_library()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.hvd_decode_table.argtypes = [ptr, _Fmt, i32]
    lib.hvd_decode_table.restype = None
    lib.hvd_table_amax.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.hvd_table_encode.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, _Fmt, ptr, i32, ptr, ptr, ptr, ptr]
    lib.hvd_table_sum.argtypes = [ptr, i64, i32, i32, ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.hvd_table_decode.argtypes = [ptr, i32, ptr, i64, i64, ptr, ptr, ptr, i32]
    lib.hvd_table_stats.argtypes = [ptr, ptr, i32, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    for name in ("hvd_table_amax", "hvd_table_encode", "hvd_table_sum", "hvd_table_decode", "hvd_table_stats"):
        getattr(lib, name).restype = None
    lib.hvd_store_release.argtypes, lib.hvd_store_release.restype = [ptr, i64], None
    lib.hvd_load_acquire.argtypes, lib.hvd_load_acquire.restype = [ptr], i64
    return lib


# Launchers' names for how many ranks share this machine: Horovod, torchrun, Open MPI, MPICH/Slurm
_LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "SLURM_NTASKS_PER_NODE")


def _thread_count() -> int:
    """HVD_APS_THREADS, else this process's cores shared by the ranks on this machine: each of
    2 ranks on 16 cores gets 8, not 16 (which would put two codec threads on every core); never
    more than the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if "HVD_APS_THREADS" in os.environ:
        value = os.environ["HVD_APS_THREADS"]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"HVD_APS_THREADS must be a number of threads >= 1, got {value!r}: set it so, or unset "
                             "it for this process's cores over the ranks on this host")
        return min(cores, int(value))
    local = next((int(os.environ[v]) for v in _LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()), 1)
    return max(1, cores // max(1, local))


_lib = _load()
available = _lib is not None
_threads = _thread_count()
_pool = named_pool(_threads, "hvd_aps_codec") if _threads > 1 else None
# Exchanges on threads beside the step's compute (beside_compute) encode and decode on their own
# thread while nothing waits for them (awaited): the backward holds every core then, and more
# codec threads only slow it down (docs/benchmarks.md, "Where the time goes")
_beside = threading.local()
_awaiting = [0]  # threads waiting for an exchange's results: the cores are the codec's then
_awaiting_lock = threading.Lock()


def beside_compute() -> None:
    """This thread's exchanges run while the step computes (an exchanger's worker thread)."""
    _beside.compute = True


@contextlib.contextmanager
def awaited() -> Iterator[None]:
    """The caller waits for exchanges' results: until it is done, every thread codes at full width."""
    with _awaiting_lock:
        _awaiting[0] += 1
    try:
        yield
    finally:
        with _awaiting_lock:
            _awaiting[0] -= 1


def _width() -> int:
    """Threads the codec's calls on this thread may use now."""
    return 1 if getattr(_beside, "compute", False) and not _awaiting[0] else _threads


@functools.lru_cache(maxsize=None)
def _c_fmt(fmt: FloatFormat, saturate: bool = False) -> _Fmt:
    return _Fmt(fmt.exp_bits, fmt.man_bits, fmt.policy, int(bool(saturate)))


# A step decodes every piece at one of a few exponents (they follow the gradients' magnitudes):
# tables made once, read-only, at most this many (for 16-bit formats 256 KiB each; the stats'
# sample tables are bounded alike)
TABLES_KEPT = 128


@functools.lru_cache(maxsize=TABLES_KEPT)
def _scaled_table(fmt: FloatFormat, shift: int, divisor: float) -> np.ndarray:
    """fmt's values at 2**-shift, divided by `divisor` in float32 (an average's N)."""
    table = np.empty(1 << fmt.bits, dtype=np.float32)
    _lib.hvd_decode_table(table.ctypes.data, _c_fmt(fmt), shift)
    if divisor != 1:
        table /= np.float32(divisor)
    table.flags.writeable = False
    return table


# A range's blocks take their exponents from a short run (they follow the gradients' magnitudes):
# one table per exponent of the run, indexed by exponent - lowest, where they hold at most this
# many values; else one per distinct exponent
_RUN_TABLE_ELEMENTS = 1 << 14


@functools.lru_cache(maxsize=TABLES_KEPT)
def _run_tables(fmt: FloatFormat, low: int, high: int, divisor: float) -> np.ndarray:
    tables = np.stack([_scaled_table(fmt, s, divisor) for s in range(low, high + 1)])
    tables.flags.writeable = False
    return tables


def _tables_for(fmt: FloatFormat, shifts: np.ndarray, divisor: Union[float, np.float32] = 1.0) -> tuple:
    """(tables, which): one decode table per exponent the blocks take (_run_tables over their
    run, else one per distinct exponent), each divided by `divisor` as the values are, and the
    int32 index of every block's table."""
    low, high = int(shifts.min()), int(shifts.max())
    if (high - low + 1) << fmt.bits <= _RUN_TABLE_ELEMENTS:
        tables, which = _run_tables(fmt, low, high, float(divisor)), shifts - np.int32(low)
    else:
        distinct, which = np.unique(shifts, return_inverse=True)
        tables = np.stack([_scaled_table(fmt, int(s), float(divisor)) for s in distinct])
    return tables, np.ascontiguousarray(which, dtype=np.int32)


# Block tables (hvd_aps._tables): one call per stage of a bucket, threads sharing its blocks
def _run_table(fn: Callable[[int, int, int, int], Any], blocks: Blocks, period: int = 1) -> List[Any]:
    """fn(b0, o0, b1, o1) over shares of the table's blocks, in parallel where it pays (period:
    Blocks.cuts'). Packed codes (period > 1) are cut into shares only where the rows come in
    stream order: elsewhere two shares' rows could share a byte, which each would rewrite."""
    width = _width()
    if period > 1 and not blocks.in_stream_order:
        width = 1
    if _pool is None or width == 1 or blocks.elements < 2 * _MIN_CHUNK:
        return [fn(0, 0, blocks.count, 0)] if blocks.count else []
    return list(_pool.map(lambda share: fn(*share[0], *share[1]), blocks.cuts(width, period)))


def table_amax(x: np.ndarray, blocks: Blocks) -> np.ndarray:
    peaks = np.empty(blocks.count, np.float32)
    xp, tp, pp = x.ctypes.data, blocks.rows.ctypes.data, peaks.ctypes.data
    _run_table(lambda b0, o0, b1, o1: _lib.hvd_table_amax(xp, tp, b0, b1, pp), blocks)
    return peaks


def table_encode(x: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, rounding: Union[Rounding, str],
                 seeds: Optional[np.ndarray], saturate: bool, message: np.ndarray,
                 residual: Optional[np.ndarray] = None) -> np.ndarray:
    shifts = np.ascontiguousarray(shifts, np.int32)
    stochastic = int(Rounding(rounding) is Rounding.STOCHASTIC)
    seeds = np.ascontiguousarray(seeds, np.uint64) if stochastic else None
    tables, which = _tables_for(fmt, shifts) if residual is not None and blocks.count else (None, None)
    args = (message.ctypes.data, _c_fmt(fmt, saturate), shifts.ctypes.data, stochastic,
            None if seeds is None else seeds.ctypes.data, None if residual is None else residual.ctypes.data,
            None if tables is None else tables.ctypes.data, None if which is None else which.ctypes.data)
    xp, tp = x.ctypes.data, blocks.rows.ctypes.data
    # threads' shares start where a packed stream's byte does: codes per byte-aligned group
    _run_table(lambda b0, o0, b1, o1: _lib.hvd_table_encode(xp, tp, b0, o0, b1, o1, *args), blocks,
               8 // math.gcd(8, fmt.bits))
    return message


def table_sum(rows: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, out: np.ndarray) -> np.ndarray:
    peaks = np.empty(blocks.count, np.float32)
    if not blocks.count:
        return peaks
    tables, which = _tables_for(fmt, np.asarray(shifts, np.int32))
    rp, stride, ranks = rows.ctypes.data, rows.strides[0], rows.shape[0]
    tp, op, tabp, wp, pp = (blocks.rows.ctypes.data, out.ctypes.data, tables.ctypes.data, which.ctypes.data,
                            peaks.ctypes.data)
    _run_table(lambda b0, o0, b1, o1: _lib.hvd_table_sum(rp, stride, ranks, fmt.bits, tp, b0, b1, op, tabp, wp, pp),
               blocks)
    return peaks


def table_decode(message: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray, out: np.ndarray,
                 divisor: np.float32 = np.float32(1), stream: bool = False) -> np.ndarray:
    if not blocks.count:
        return out
    tables, which = _tables_for(fmt, np.asarray(shifts, np.int32), divisor)
    mp, tp, op, tabp, wp = (message.ctypes.data, blocks.rows.ctypes.data, out.ctypes.data, tables.ctypes.data,
                            which.ctypes.data)
    _run_table(lambda b0, o0, b1, o1: _lib.hvd_table_decode(mp, fmt.bits, tp, b0, b1, op, tabp, wp, int(stream)),
               blocks)
    return out


def table_stats(x: np.ndarray, message: np.ndarray, fmt: FloatFormat, blocks: Blocks, shifts: np.ndarray,
                first: np.ndarray, step: np.ndarray, limits: np.ndarray) -> np.ndarray:
    sums = np.zeros((blocks.count, SAMPLE_SUMS), np.float64)
    if not blocks.count:
        return sums
    tables, which = _tables_for(fmt, np.asarray(shifts, np.int32))
    first, step = np.ascontiguousarray(first, np.int64), np.ascontiguousarray(step, np.int64)
    limits = np.ascontiguousarray(limits, np.float32)
    ptrs = [a.ctypes.data for a in (x, message)], [a.ctypes.data for a in (first, step, tables, which, limits, sums)]
    tp = blocks.rows.ctypes.data
    _run_table(lambda b0, o0, b1, o1: _lib.hvd_table_stats(*ptrs[0], fmt.bits, tp, b0, b1, *ptrs[1]), blocks)
    return sums


def store_release(address: int, value: int) -> None:
    """An int64 counter in shared memory set after the data it publishes (hvd_aps._host_memory)."""
    _lib.hvd_store_release(address, value)


def load_acquire(address: int) -> int:
    """An int64 counter in shared memory read before the data it guards."""
    return _lib.hvd_load_acquire(address)


# A chunk's few re-encode exponents: NumPy's float64 arithmetic is the reference, and fast enough.
table_shifts = _numpy_engine.table_shifts
