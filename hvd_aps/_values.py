"""wire="values": the gradient scaled by the agreed APS shift, rounded onto the format's grid and
carried by the framework's own allreduce in the narrowest standard dtype that holds that grid
exactly and that it sums: float16 for every format of 8 bits and below (half of fp32's bytes),
float32 otherwise. Framework-neutral: NumPy or CuPy arrays in and out.
"""
import numpy as np

from . import _arrays, codec, scaling
from .config import Scaling


def carrier(fmt) -> np.dtype:
    return np.dtype(np.float16 if fmt.fits_float16 else np.float32)


def to_wire(config, stats, x, agreed_amax: float, world_size: int, seed: int, label: str) -> tuple:
    """x scaled by the agreed APS shift and rounded onto the grid: (carrier array, shift)."""
    xp = _arrays.array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    fmt, finite, dtype = config.fmt, bool(np.isfinite(agreed_amax)), carrier(config.fmt)
    # the framework sums the carrier dtype: the sum needs headroom only within that dtype's range
    sum_max = float(np.finfo(dtype).max)
    shift = scaling.shift_for(agreed_amax, world_size, fmt, sum_max) if finite and config.scaling is Scaling.APS else 0
    if finite:
        wire = codec.quantize(x, fmt, config.rounding, seed, config.saturate, shift, unscale=False, dtype=dtype)
    else:  # unscaled and unrounded: the NaN/Inf reaches every rank's sum
        wire = x.astype(dtype)
    limit = np.float32(np.ldexp(fmt.max, -shift)) if finite else None
    stats.record(label, stats.of_values(x, lambda step: from_wire(wire.ravel()[::step], shift), shift, fmt, limit,
                                        wire.nbytes))
    return wire, shift


def from_wire(wire, shift: int):
    """Undo the shift: float32 values of the summed wire tensor (exact, one rounding at most)."""
    xp = _arrays.array_module(wire)
    return xp.ldexp(wire.astype(xp.float32), xp.int32(-int(shift))).astype(xp.float32)
