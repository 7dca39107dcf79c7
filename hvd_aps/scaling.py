"""Auto-Precision Scaling: the power-of-two shift that fits an N-way gradient sum into a format.

Every rank must apply the same shift, so the input is the *agreed* max |g| over all ranks (one
Max-allreduce of each rank's `codec.amax`); the output is an integer exponent, so scaling and
unscaling are exact. No I/O here: the compressors and the emulator call these functions.

The rule is CPD's (Han et al., arXiv 1911.08907) with three changes:
- the scaled values land within one binade of the format's max (CPD scales N*max|g| up to
  2**bias, which wastes up to 2.8 binades of e4m3fn);
- the headroom is only what the accumulator (float16 or float32, not the format) needs
  (`sum_max`): CPD's x N would spend 5 binades at 32 ranks, all of e3m0's range;
- amax 0 gives shift 0 (CPD sends NaN from log2(0)), and so does a non-finite amax: callers send
  such a tensor unscaled, so every rank ends with a non-finite result, not finite garbage.
"""
from types import ModuleType
from typing import Optional, Sequence, Union

import numpy as np

from ._arrays import array_module
from ._engine import Array
from .formats import FloatFormat


def shift_for(amax: float, world_size: int, fmt: Union[FloatFormat, str], sum_max: Optional[float] = None) -> int:
    """The largest shift s with amax * 2**s <= fmt.max (every rank's term fits the format) and
    the sum of world_size such terms, each *after rounding*, stays within sum_max (where the sum is
    accumulated; None: in the format itself, the paper's setting, so the x N headroom).
    0 for amax 0 or not finite."""
    return int(shifts_for(np.array([amax], dtype=np.float64), world_size, fmt, sum_max)[0])


def shifts_for(amaxes: Union[np.ndarray, Sequence[float]], world_size: int, fmt: Union[FloatFormat, str],
               sum_max: Optional[float] = None) -> np.ndarray:
    """shift_for over an array of per-tensor amaxes (one grouped Max-allreduce's result)."""
    fmt = FloatFormat.parse(fmt)
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    amaxes = np.asarray(amaxes, dtype=np.float64)
    if np.any(amaxes < 0):
        raise ValueError("amax must be >= 0 (it is a max of absolute values)")
    return shifts_under(amaxes, limit_for(world_size, fmt, sum_max))


def limit_for(world_size: int, fmt: FloatFormat, sum_max: Optional[float] = None) -> float:
    """The largest scaled term: both bounds at once (the largest shift under the smaller limit is
    the largest under both)."""
    return min(fmt.max, _term_limit(world_size, fmt, sum_max))


def shifts_under(amaxes: Array, limit: float) -> Array:
    """Per max |g|, the largest s with amax * 2**s <= limit (0 for amax 0 or not finite): the
    reference of the engines' table_shifts (the CUDA kernel does the same float64 arithmetic)."""
    xp = array_module(amaxes)
    amaxes = amaxes.astype(xp.float64)
    usable = xp.isfinite(amaxes) & (amaxes > 0)
    return xp.where(usable, _largest_shift(xp, xp.where(usable, amaxes, 1.0), limit), 0)


def _term_limit(world_size: int, fmt: FloatFormat, sum_max: Optional[float]) -> float:
    """Largest scaled term whose rounding, added world_size times, stays within sum_max: rounding to
    nearest adds at most half an ulp, a relative 2**-(man_bits+1) for normals and half the
    smallest subnormal below them. Where even world_size smallest subnormals overflow, no shift
    can help; the relative bound is then the best there is."""
    per_term = (fmt.max if sum_max is None else sum_max) / world_size
    relative = per_term / (1 + 2.0 ** -(fmt.man_bits + 1))
    absolute = per_term - fmt.min_subnormal / 2
    return min(relative, absolute) if absolute > 0 else relative


def _largest_shift(xp: ModuleType, peak: Array, limit: float) -> Array:
    """Largest integer s with peak * 2**s <= limit (exact: float64 products of float32 values and
    small integers, and powers of two)."""
    _, exp = xp.frexp(limit / peak)
    s = exp.astype(xp.int64) - 1  # floor(log2(limit / peak)): exact but for a subnormal quotient (below)
    s += xp.ldexp(peak, (s + 1).astype(xp.int32)) <= limit
    s -= xp.ldexp(peak, s.astype(xp.int32)) > limit
    return s
