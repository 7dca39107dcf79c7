"""What compression did to each tensor: TensorStats, and the recorder a compressor keeps them in.

Stats are sampled (an evenly strided sample of about `sample` elements of each tensor, scaled up)
so they can stay on: measured on a 4M-element tensor, every element costs 12x the encode's time
(21 ms against 1.7 ms), the default sample half of it (0.8 ms).
"""
import dataclasses
import functools
import math
import threading

import numpy as np

from . import _arrays, _host_engine, codec
from ._schedule import NATIVE_BYTES

STATS_SAMPLE = 1 << 12  # elements per tensor the stats look at by default
STATS_COLUMNS = ["tensor", "format", "elements", "measured", "shift", "flushed", "saturated", "relative_error",
                 "bytes_in", "bytes_carried"]


@dataclasses.dataclass
class TensorStats:
    """What compression did to one tensor, or (summed with +) to many."""
    shift: int = 0          # APS exponent applied before rounding (0 with scaling="none")
    elements: int = 0
    nonzero: int = 0        # nonzero inputs ...
    flushed_count: int = 0  # ... of which rounded to zero
    saturated: int = 0      # finite inputs whose scaled magnitude exceeded the format's max
    bytes_in: int = 0
    bytes_carried: int = 0  # what the wire carries for it (per rank, before the exchange)
    finite: bool = True     # False: some rank held NaN/Inf, so the tensor went unscaled
    error_sq: float = 0.0   # sum of (sent - input)^2, the sent values unscaled ...
    norm_sq: float = 0.0    # ... and of input^2: sums, so they add up over tensors and calls
    measured: int = 0       # elements looked at: counts and sums above are scaled up from them
    fmt: str = ""           # the format it went out in (hybrid: narrow or wide; a fallback: its dtype)

    @property
    def flushed(self) -> float:
        """Fraction of nonzero inputs that rounded to zero."""
        return self.flushed_count / self.nonzero if self.nonzero else 0.0

    @property
    def relative_error(self) -> float:
        """||q(g) - g|| / ||g||: what this rank's encode changed (0 for zeros; NaN/Inf tensors count 0)."""
        return math.sqrt(self.error_sq / self.norm_sq) if self.norm_sq else 0.0

    def __add__(self, other: "TensorStats") -> "TensorStats":
        return TensorStats(other.shift, self.elements + other.elements, self.nonzero + other.nonzero,
                           self.flushed_count + other.flushed_count, self.saturated + other.saturated,
                           self.bytes_in + other.bytes_in, self.bytes_carried + other.bytes_carried,
                           self.finite and other.finite, self.error_sq + other.error_sq,
                           self.norm_sq + other.norm_sq, self.measured + other.measured, other.fmt)

    def __str__(self) -> str:
        ratio = self.bytes_carried / self.bytes_in if self.bytes_in else 0.0
        sampled = f" (from {self.measured} sampled elements)" if self.measured < self.elements else ""
        return (f"{self.bytes_in} gradient bytes in, {self.bytes_carried} carried ({ratio:.2f}x), "
                f"{self.flushed:.2%} of nonzero values flushed to zero, {self.saturated} saturated, "
                f"relative encode error {self.relative_error:.3e}{sampled}")

    def row(self, label: str) -> list:
        return [label, self.fmt, self.elements, self.measured, self.shift, f"{self.flushed:.4f}", self.saturated,
                f"{self.relative_error:.4e}", self.bytes_in, self.bytes_carried]


class StatsRecorder:
    """The last TensorStats per tensor label, their sum since reset(), and the code bytes this
    rank sent. Thread-safe: exchanges record from several threads."""

    def __init__(self, enabled: bool = True, sample: int = STATS_SAMPLE):
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise ValueError(f"stats_sample must be an int >= 0, got {sample!r}")
        self.enabled, self.sample = bool(enabled), sample
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.last, self.total, self.bytes_sent = {}, TensorStats(), 0

    def record(self, label: str, stats: "TensorStats | None") -> None:
        if not self.enabled or stats is None:
            return
        with self._lock:
            self.last[label] = stats
            self.total = self.total + stats

    def record_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes

    def passed_through(self, label: str, elements: int, dtype: str = "float32") -> None:
        """A tensor the framework's own allreduce carried (too small for codes, or a fallback) in
        `dtype`, a name of NATIVE_BYTES (bfloat16 too, which NumPy alone does not know)."""
        self.record(label, TensorStats(elements=elements, bytes_in=4 * elements,
                                       bytes_carried=NATIVE_BYTES[dtype] * elements, measured=elements, fmt=dtype))

    def table(self, csv: bool = False) -> str:
        """The last stats of every tensor label as an aligned table, or CSV with a header."""
        with self._lock:
            rows = [stats.row(label) for label, stats in self.last.items()]
        cells = [STATS_COLUMNS] + [[str(c) for c in row] for row in rows]
        if csv:
            return "\n".join(",".join(row) for row in cells) + "\n"
        widths = [max(len(row[i]) for row in cells) for i in range(len(STATS_COLUMNS))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells) + "\n"

    def of_codes(self, x, row, pos: int, shift: int, fmt, whole: int = 0, at: int = 0) -> "TensorStats | None":
        """Stats of float32 values x encoded into codes pos .. pos + x.size of the packed stream
        `row` in `fmt` at `shift` (row None: they held NaN/Inf); None when stats are off. x is
        elements at .. at + x.size of a tensor of `whole` elements (0: x is all of it): the sample
        stride comes from the whole tensor, so a tensor is sampled about `sample` times however the
        exchange cut it into pieces. Only the sampled codes are read."""
        if not self.enabled:
            return None
        xp = _arrays.array_module(x)
        if row is None:
            return TensorStats(elements=x.size, bytes_in=4 * x.size, finite=False, fmt=str(fmt))
        step = _arrays.sample_stride(whole or x.size, self.sample)
        first = -at % step  # the piece's first element on the tensor's sampling grid
        sent = _values(fmt, shift, xp)[codec.codes_at(row, fmt, xp.arange(pos + first, pos + x.size, step))]
        return measure(xp, x.ravel()[first::step], sent, np.float32(np.ldexp(fmt.max, -shift)), shift, x.size,
                       codec.packed_size(x.size, fmt), str(fmt), scale=step)

    def of_values(self, x, sent, shift: int, fmt, limit, carried: int) -> "TensorStats | None":
        """Stats of x against the values `sent` for it (both sampled alike here), limit None where
        it held NaN/Inf."""
        if not self.enabled:
            return None
        xp = _arrays.array_module(x)
        step = _arrays.sample_stride(x.size, self.sample)
        return measure(xp, x.ravel()[::step], sent(step), limit, shift, x.size, carried, str(fmt))


# a step's tensors take a few shifts each format: as many tables kept as the host engine keeps
@functools.lru_cache(maxsize=_host_engine.TABLES_KEPT)
def _values(fmt, shift: int, xp):
    """Every code's value in `fmt` at `shift` (codec.decode of them all), so a tensor's sample is
    looked up in one indexing instead of a decode of its own: a table per format and shift, as
    the codec's engines decode with."""
    return codec.decode(xp.arange(1 << fmt.bits, dtype=fmt.code_dtype), fmt, shift)


def measure(xp, x, sent, limit, shift: int, elements: int, bytes_carried: int, fmt: str,
            scale: float = None) -> TensorStats:
    """TensorStats of a tensor of `elements` float32 values from x (all of them, or a sample)
    against the values sent for x, unscaled; counts and sums scaled up to the whole tensor by
    `scale` (default elements / x.size; a strided sample's stride) (limit None: it held NaN/Inf
    and went unscaled, so there is no error to speak of)."""
    finite = limit is not None
    if scale is None:
        scale = elements / x.size if x.size else 1.0
    if xp is not np:  # a GPU's sample: one copy to the host, where five reductions cost no kernels and syncs
        x, sent = np.split(xp.concatenate([x.ravel(), sent.ravel().astype(np.float32)]).get(), [x.size])
        xp = np
    nonzero = int(xp.count_nonzero(x))
    saturated = int(xp.count_nonzero((x > limit) | (x < -limit))) if finite else 0
    x64 = x.astype(xp.float64)
    diff = sent.astype(xp.float64) - x64
    return TensorStats(shift=shift, elements=elements, nonzero=round(nonzero * scale),
                       flushed_count=round((nonzero - int(xp.count_nonzero(sent))) * scale),
                       saturated=round(saturated * scale), bytes_in=4 * elements, bytes_carried=bytes_carried,
                       finite=finite, error_sq=float(xp.dot(diff, diff)) * scale if finite else 0.0,
                       norm_sq=float(xp.dot(x64, x64)) * scale if finite else 0.0, measured=x.size, fmt=fmt)
