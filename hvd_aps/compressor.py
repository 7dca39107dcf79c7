"""APSCompressor: one Horovod Compressor for horovod.torch and horovod.tensorflow alike.

Horovod sums whatever compress() returns and cannot sum uint8 codes, so on this (stock) path the
gradient is scaled by the agreed APS shift, rounded onto the format's grid and carried in the
narrowest standard dtype that holds that grid exactly and that Horovod sums: float16 for every
format of 8 bits and below (half of fp32's bytes), float32 otherwise (pure emulation). The
codes-on-the-wire path that sends 1 byte or less per element is `hvd_aps.torch.DistributedOptimizer`.

This class holds the numerics (NumPy, through the codec); the per-framework steps (max |g|, the
Max-allreduce, moving data between tensor and array) live in thin adapters, chosen per tensor.
"""
import dataclasses
import secrets
import threading

import numpy as np

from . import codec, scaling
from .formats import FloatFormat

_ADAPTERS = {"torch": "hvd_aps.torch.adapter", "tensorflow": "hvd_aps.tensorflow.adapter"}
_SCALINGS = ("aps", None)


@dataclasses.dataclass
class TensorStats:
    """What compress() did to one tensor, or (summed with +) to many."""
    shift: int = 0          # APS exponent applied before rounding (0 with scaling=None)
    elements: int = 0
    nonzero: int = 0        # nonzero inputs ...
    flushed_count: int = 0  # ... of which rounded to zero
    saturated: int = 0      # finite inputs whose scaled magnitude exceeded the format's max
    bytes_in: int = 0
    bytes_carried: int = 0  # what Horovod moves for it (per rank, before the allreduce)
    finite: bool = True     # False: some rank held NaN/Inf, so the tensor went unscaled

    @property
    def flushed(self):
        """Fraction of nonzero inputs that rounded to zero."""
        return self.flushed_count / self.nonzero if self.nonzero else 0.0

    def __add__(self, other):
        return TensorStats(other.shift, self.elements + other.elements, self.nonzero + other.nonzero,
                           self.flushed_count + other.flushed_count, self.saturated + other.saturated,
                           self.bytes_in + other.bytes_in, self.bytes_carried + other.bytes_carried,
                           self.finite and other.finite)

    def __str__(self):
        ratio = self.bytes_carried / self.bytes_in if self.bytes_in else 0.0
        return (f"{self.bytes_in} gradient bytes in, {self.bytes_carried} carried ({ratio:.2f}x), "
                f"{self.flushed:.2%} of nonzero values flushed to zero, {self.saturated} saturated")


def _adapter(tensor):
    """The framework adapter module for a tensor, or None for anything else."""
    root = type(tensor).__module__.split(".")[0]
    if root not in _ADAPTERS:
        return None
    # __import__, not importlib: TF's autograph traces compress() and warns on importlib's frames
    return __import__(_ADAPTERS[root], fromlist=["compress"])


class APSCompressor:
    """Horovod Compressor that sends gradients on a custom float format's grid with APS.

    fmt: a FloatFormat or its name ("e4m3", "e5m2", "e3m0", ...).
    rounding: "nearest" (ties to even) or "stochastic" (seeded per rank and call).
    scaling: "aps" (default) or None for the naive cast without scaling, for comparison.
    saturate: clamp finite overflow to +-max instead of Inf/NaN.
    stats: record what each compress() did (costs two passes over the data): `stats[label]` holds
    the last call per tensor label (TF: the gradient's graph name; torch: dtype and shape, so
    tensors of one shape share an entry), `totals()` the sum of every call since `reset_stats()`.

    Every rank must use an equal compressor: compress() checks the format and options across ranks
    in the same Max-allreduce that agrees on the scale, and raises on a mismatch.
    """

    def __init__(self, fmt, rounding="nearest", scaling="aps", saturate=False, seed=None, stats=True):
        self.fmt = FloatFormat.parse(fmt)
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        if scaling not in _SCALINGS:
            raise ValueError(f"scaling must be 'aps' or None, got {scaling!r}")
        self.rounding, self.scaling, self.saturate, self.collect_stats = rounding, scaling, saturate, stats
        self.carrier = np.dtype(np.float16 if self.fmt.fits_float16 else np.float32)
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._calls, self._lock = 0, threading.Lock()
        self.reset_stats()

    def __repr__(self):
        return (f"APSCompressor({str(self.fmt)!r}, rounding={self.rounding!r}, scaling={self.scaling!r}, "
                f"saturate={self.saturate})")

    # Horovod's Compressor interface -----------------------------------------------------------
    def compress(self, tensor):
        adapter = _adapter(tensor)
        if adapter is None or not adapter.is_dense_float(tensor):
            return tensor, None
        return adapter.compress(tensor, self)

    def decompress(self, tensor, ctx):
        if ctx is None:  # passed through, or Horovod's sparse path calling without a context
            return tensor
        return _adapter(tensor).decompress(tensor, ctx, self)

    # The numerics, on NumPy arrays; adapters call these -----------------------------------------
    @property
    def signature(self):
        """A small integer naming fmt and options: equal on every rank or compress() raises."""
        f = self.fmt
        return (((f.exp_bits * 32 + f.man_bits) * 2 + (f.variant == "fn")) * 2
                + (self.rounding == "stochastic")) * 4 + (self.scaling == "aps") * 2 + bool(self.saturate)

    def metadata(self, *local_amaxes):
        """The vector every rank Max-allreduces: [amax..., signature, -signature]."""
        return np.array([*local_amaxes, self.signature, -self.signature], np.float32)

    def check_agreed(self, agreed):
        """From the Max-allreduced metadata to the agreed amax, after checking the signatures."""
        return float(self.check_agreed_many(agreed, 1)[0])

    def check_agreed_many(self, agreed, count):
        """check_agreed for a metadata vector of `count` amaxes (one grouped allreduce)."""
        agreed = np.asarray(agreed, np.float32).ravel()
        if agreed.size != count + 2:
            raise ValueError(f"metadata of {agreed.size} values for {count} tensors: ranks disagree on the bucket")
        high, neg_low = float(agreed[-2]), float(agreed[-1])
        if high != -neg_low:
            raise ValueError(f"APSCompressor mismatch across ranks: this rank uses {self!r} (signature "
                             f"{self.signature}) but signatures range from {-neg_low:g} to {high:g}")
        return agreed[:count].astype(np.float64)

    def next_seed(self, rank):
        """Seed for one stochastic encode: from (seed, rank, call number), so no two ranks or calls
        share random bits."""
        with self._lock:  # the codes path encodes on two threads
            self._calls += 1
            return hash((self.seed, rank, self._calls)) & ((1 << 64) - 1)

    def to_wire(self, x, agreed_amax, world_size, rank, label):
        """Scale x (NumPy, or CuPy on a GPU) by the agreed APS shift and round it onto the grid:
        (carrier array, shift)."""
        xp = codec.array_module(x)
        x = xp.ascontiguousarray(x, dtype=xp.float32)
        finite = bool(np.isfinite(agreed_amax))
        # Horovod sums the carrier dtype: the sum needs headroom only within that dtype's range
        sum_max = float(np.finfo(self.carrier).max)
        shift = scaling.shift_for(agreed_amax, world_size, self.fmt, sum_max) if finite and self.scaling else 0
        if finite:
            wire = codec.quantize(x, self.fmt, self.rounding, self.next_seed(rank), self.saturate, shift,
                                  unscale=False, dtype=self.carrier)
        else:  # unscaled and unrounded: the NaN/Inf reaches every rank's sum
            wire = x.astype(self.carrier)
        if self.collect_stats:
            self.stats[label] = self._measure(xp, x, wire, shift, finite)
            self._total = self._total + self.stats[label]
        return wire, shift

    def from_wire(self, wire, shift):
        """Undo the shift: float32 values of the summed wire tensor (exact, one rounding at most)."""
        xp = codec.array_module(wire)
        return xp.ldexp(wire.astype(xp.float32), xp.int32(-int(shift))).astype(xp.float32)

    def _measure(self, xp, x, wire, shift, finite):
        limit = np.float32(np.ldexp(self.fmt.max, -shift)) if finite else np.inf
        nonzero = int(xp.count_nonzero(x))
        return TensorStats(shift=shift, elements=x.size, nonzero=nonzero,
                           flushed_count=nonzero - int(xp.count_nonzero(wire)),
                           saturated=int(xp.count_nonzero((x > limit) | (x < -limit))) if finite else 0,
                           bytes_in=x.nbytes, bytes_carried=wire.nbytes, finite=finite)

    def totals(self):
        """TensorStats summed over every compress() since reset_stats()."""
        return self._total

    def reset_stats(self):
        self.stats, self._total = {}, TensorStats()

def from_name(name, stock):
    """A compressor from a command-line name: "none" and "fp16" give Horovod's own (`stock` is the
    framework's horovod Compression namespace), "aps-<format>" an APSCompressor, and
    "naive-<format>" the same format without scaling."""
    if name in ("none", "fp16"):
        return getattr(stock, name)
    kind, _, fmt = name.partition("-")
    if kind not in ("aps", "naive") or not fmt:
        raise ValueError(f"unknown compression {name!r}: use none, fp16, aps-<format> or naive-<format>")
    return APSCompressor(fmt, scaling="aps" if kind == "aps" else None)
