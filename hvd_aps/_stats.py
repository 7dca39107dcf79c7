"""What compression did to each tensor: TensorStats, and the recorder a compressor keeps them in.

Stats are sampled (an evenly strided sample of about `sample` elements of each tensor, scaled up)
so they can stay on: measured on a 4M-element tensor, every element costs 12x the encode's time
(21 ms against 1.7 ms), the default sample half of it (0.8 ms).
"""
import dataclasses
import math
import threading

import numpy as np

from . import _arrays, _device
from .config import Path

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


@dataclasses.dataclass
class BucketStats:
    """The TensorStats of a bucket's tensors as columns, one row per label: what an exchange
    records, so a step costs one record per bucket, not one object per tensor (rows are made
    when someone reads them)."""
    labels: list
    fmts: list
    shift: np.ndarray
    elements: np.ndarray
    nonzero: np.ndarray
    flushed_count: np.ndarray
    saturated: np.ndarray
    bytes_carried: np.ndarray
    finite: np.ndarray
    error_sq: np.ndarray
    norm_sq: np.ndarray
    measured: np.ndarray

    @classmethod
    def of_sums(cls, labels, fmts, shift, elements, scale, sums, bytes_carried, finite) -> "BucketStats":
        """From per-row sample sums (_tables.SAMPLE_SUMS columns: samples, nonzero,
        nonzero sent, saturated, error^2, input^2), scaled up by each row's sample stride."""
        nonzero = np.round(sums[:, 1] * scale).astype(np.int64)
        keep = np.asarray(finite, bool)
        return cls(list(labels), list(fmts), np.asarray(shift, np.int64), np.asarray(elements, np.int64),
                   np.where(keep, nonzero, 0), np.where(keep, np.round((sums[:, 1] - sums[:, 2]) * scale), 0).astype(
                       np.int64), np.where(keep, np.round(sums[:, 3] * scale), 0).astype(np.int64),
                   np.asarray(bytes_carried, np.int64), keep, np.where(keep, sums[:, 4] * scale, 0.0),
                   np.where(keep, sums[:, 5] * scale, 0.0), sums[:, 0].astype(np.int64))

    def row(self, i: int) -> TensorStats:
        return TensorStats(int(self.shift[i]), int(self.elements[i]), int(self.nonzero[i]),
                           int(self.flushed_count[i]), int(self.saturated[i]), 4 * int(self.elements[i]),
                           int(self.bytes_carried[i]), bool(self.finite[i]), float(self.error_sq[i]),
                           float(self.norm_sq[i]), int(self.measured[i]), self.fmts[i])

    def total(self) -> TensorStats:
        """The rows summed as TensorStats.__add__ sums them (shift and format: the last row's)."""
        if not self.labels:
            return TensorStats()
        return TensorStats(int(self.shift[-1]), int(self.elements.sum()), int(self.nonzero.sum()),
                           int(self.flushed_count.sum()), int(self.saturated.sum()), 4 * int(self.elements.sum()),
                           int(self.bytes_carried.sum()), bool(self.finite.all()), float(self.error_sq.sum()),
                           float(self.norm_sq.sum()), int(self.measured.sum()), self.fmts[-1])


class StatsRecorder:
    """The last TensorStats per tensor label, their sum since reset(), and the code bytes this
    rank sent. Thread-safe: exchanges record from several threads, and what waits to be read
    from a device is recorded in the order it came."""

    def __init__(self, enabled: bool = True, sample: int = STATS_SAMPLE):
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise ValueError(f"stats_sample must be an int >= 0, got {sample!r}")
        self.enabled, self.sample = bool(enabled), sample
        self._lock = threading.Lock()
        self._settling = threading.RLock()  # one settle at a time, against reset() too
        self.reset()

    def reset(self) -> None:
        with self._settling, self._lock:
            self._last, self._buckets, self._total, self.bytes_sent = {}, {}, TensorStats(), 0
            self._shifts = {}  # bucket name -> its tensors' APS shifts in its last exchange
            self._later = []  # (bucket name or None, parts or a label, make or stats), in the order they came

    @property
    def total(self) -> TensorStats:
        """Every TensorStats recorded since reset(), summed."""
        self.settle()
        return self._total

    @property
    def last(self) -> dict:
        """label -> the last TensorStats recorded for it (buckets' rows made now)."""
        self.settle()
        with self._lock:
            for bucket in self._buckets.values():
                self._rows_of(bucket)
            self._buckets.clear()
            return dict(self._last)

    def record(self, label: str, stats: "TensorStats | None") -> None:
        if not self.enabled or stats is None:
            return
        with self._lock:
            if self._later:  # after what waits to be read, without reading it here
                self._later.append((None, label, stats))
                return
            self._record(label, stats)

    def _record(self, label: str, stats: TensorStats) -> None:
        """record(), the lock held."""
        for name in [n for n, b in self._buckets.items() if label in b.labels]:  # theirs came first
            self._rows_of(self._buckets.pop(name))
        self._last[label] = stats
        self._total = self._total + stats

    def record_bucket(self, name: str, stats: BucketStats) -> None:
        """A bucket's exchange, as one BucketStats under the bucket's `name` (its rows replace the
        last step's of that name; rows are made when `last` is read)."""
        if not self.enabled:
            return
        with self._lock:
            if self._later:
                self._later.append((name, (None, []), lambda _: stats))
                return
            self._record_bucket_locked(name, stats)

    def bucket_shifts(self) -> dict:
        """Bucket name -> its tensors' APS shifts in its last exchange."""
        self.settle()
        with self._lock:
            return dict(self._shifts)

    def _record_bucket_locked(self, name: str, stats: BucketStats) -> None:
        self._shifts[name] = stats.shift
        total = stats.total()
        earlier = self._buckets.pop(name, None)
        if earlier is None or earlier.labels != stats.labels:
            if earlier is not None:
                self._rows_of(earlier)
            self._last.update((label, None) for label in stats.labels if label not in self._last)  # places
        self._buckets[name] = stats
        if stats.labels:
            self._total = self._total + total

    def record_bucket_later(self, name: str, parts: list, make) -> None:
        """A bucket's exchange whose sample sums (`parts`: arrays where the exchange ran, on the
        stream current now) are read later: make(parts on the host) -> its BucketStats, recorded
        when the stats are read or when the bucket comes back (the next step), every bucket
        waiting then in one copy a stream. On a device that is one read per step, not one per
        bucket, and none while the bucket runs."""
        if not self.enabled:
            return
        with self._lock:
            due = any(entry[0] == name for entry in self._later)
        if due:
            self.settle()
        with self._lock:
            self._later.append((name, (_device.where(parts[0]) if parts else None, parts), make))

    def settle(self) -> None:
        """Record everything waiting since record_bucket_later, in the order it came; device sums
        copied to the host on the stream that made them, one copy per stream."""
        with self._settling:
            with self._lock:
                later = self._later
            if not later:
                return
            host = _device.copied_to_host([parts for name, parts, _ in later if name is not None])
            with self._lock:
                self._later = self._later[len(later):]  # what came meanwhile waits for the next settle
                for name, parts, make in later:
                    if name is None:
                        self._record(parts, make)
                    else:
                        self._record_bucket_locked(name, make(next(host)))

    def _rows_of(self, bucket: BucketStats) -> None:
        for i, label in enumerate(bucket.labels):
            self._last[label] = bucket.row(i)

    def record_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes

    def passed_through(self, label: str, elements: int, path: Path = Path.FLOAT32) -> None:
        """A tensor the framework's own allreduce carried (too small for codes, or a fallback) on
        the native `path`."""
        self.record(label, TensorStats(elements=elements, bytes_in=4 * elements,
                                       bytes_carried=path.itemsize * elements, measured=elements, fmt=path.value))

    def table(self, csv: bool = False) -> str:
        """The last stats of every tensor label as an aligned table, or CSV with a header."""
        rows = [stats.row(label) for label, stats in self.last.items()]
        cells = [STATS_COLUMNS] + [[str(c) for c in row] for row in rows]
        if csv:
            return "\n".join(",".join(row) for row in cells) + "\n"
        widths = [max(len(row[i]) for row in cells) for i in range(len(STATS_COLUMNS))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells) + "\n"

    def of_values(self, x, sent, shift: int, fmt, limit, carried: int) -> "TensorStats | None":
        """Stats of x against the values `sent` for it (both sampled alike here), limit None where
        it held NaN/Inf."""
        if not self.enabled:
            return None
        xp = _arrays.array_module(x)
        step = _arrays.sample_stride(x.size, self.sample)
        return measure(xp, x.ravel()[::step], sent(step), limit, shift, x.size, carried, str(fmt))


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
