"""Auto-Precision Scaling: the power-of-two shift that fits an N-way gradient sum into a format.

Every rank must apply the same shift, so the input is the *agreed* max |g| over all ranks (one
Max-allreduce of each rank's `codec.amax`); the output is an integer exponent, so scaling and
unscaling are exact. No I/O here: the compressors and the emulator call these functions.

The rule is CPD's (Han et al., arXiv 1911.08907) with two fixes:
- CPD scales N*max|g| up to 2**bias; that ignores where the format's max really is and wastes up
  to 2.8 binades (e4m3fn). Here N*max|g|*2**shift lands in (max/2, max]: the largest power-of-two
  scale under which the exact N-way sum cannot overflow, wasting less than one binade.
- CPD takes log2(0) on an all-zero gradient and sends NaN. Here amax 0 gives shift 0 (zeros stay
  zeros), and a non-finite amax is reported, so callers send such a tensor unscaled and every
  rank ends with a non-finite result rather than finite garbage.
"""
import numpy as np

from .formats import FloatFormat


def shift_for(amax, world_size, fmt):
    """Shift s with world_size * amax * 2**s <= fmt.max < 2 * world_size * amax * 2**s.

    amax: agreed max |g| (>= 0). Returns 0 when amax is 0 or not finite (callers send a
    non-finite tensor unscaled; see the module docstring).
    """
    return int(shifts_for(np.array([amax], dtype=np.float64), world_size, fmt)[0])


def shifts_for(amaxes, world_size, fmt):
    """shift_for over an array of per-tensor amaxes (one grouped Max-allreduce's result)."""
    fmt = FloatFormat.parse(fmt)
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    amaxes = np.asarray(amaxes, dtype=np.float64)
    if np.any(amaxes < 0):
        raise ValueError("amax must be >= 0 (it is a max of absolute values)")
    usable = np.isfinite(amaxes) & (amaxes > 0)
    peak = np.where(usable, amaxes, 1.0) * world_size  # exact: float32 amax times a small int
    _, exp = np.frexp(fmt.max / peak)
    s = exp.astype(np.int64) - 1  # floor(log2(max / peak)), up to the division's last-bit error
    s += np.ldexp(peak, s + 1) <= fmt.max
    s -= np.ldexp(peak, s) > fmt.max
    return np.where(usable, s, 0)
