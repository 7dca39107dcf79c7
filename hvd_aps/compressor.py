"""APSCompressor: one Horovod Compressor for horovod.torch and horovod.tensorflow alike.

wire="codes" (the default) sends the format's codes themselves, 1 byte per element for 8-bit
formats and packed below that: compress() hands the gradient to a codes exchange
(hvd_aps.tokens, hvd_aps.exchange) and gives Horovod a one-element token to allreduce, whose
result tells decompress() what op and scale factors Horovod applied.

wire="values": Horovod sums whatever compress() returns and cannot sum uint8 codes, so the
gradient is scaled by the agreed APS shift, rounded onto the format's grid and carried in the
narrowest standard dtype that holds that grid exactly and that Horovod sums: float16 for every
format of 8 bits and below (half of fp32's bytes), float32 otherwise.

This class holds the numerics (NumPy, through the codec) and the state; the per-framework steps
(collectives, moving data between tensor and array) live in thin adapters, chosen per tensor.
"""
import dataclasses
import math
import secrets
import threading

import numpy as np

from . import _arrays, codec, scaling, tokens, wire
from .config import (DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, DEFAULT_HYBRID_THRESHOLD, DEFAULT_MIN_ELEMENTS,
                     APSConfig)

_ADAPTERS = {"torch": "hvd_aps.torch.adapter", "tensorflow": "hvd_aps.tensorflow.adapter"}


@dataclasses.dataclass
class TensorStats:
    """What compress() did to one tensor, or (summed with +) to many."""
    shift: int = 0          # APS exponent applied before rounding (0 with scaling="none")
    elements: int = 0
    nonzero: int = 0        # nonzero inputs ...
    flushed_count: int = 0  # ... of which rounded to zero
    saturated: int = 0      # finite inputs whose scaled magnitude exceeded the format's max
    bytes_in: int = 0
    bytes_carried: int = 0  # what Horovod moves for it (per rank, before the allreduce)
    finite: bool = True     # False: some rank held NaN/Inf, so the tensor went unscaled
    error_sq: float = 0.0   # sum of (sent - input)^2, the sent values unscaled ...
    norm_sq: float = 0.0    # ... and of input^2: sums, so they add up over tensors and calls
    measured: int = 0       # elements looked at: counts and sums above are scaled up from them
    fmt: str = ""           # the format it went out in (hybrid precision: the narrow or the wide one)

    @property
    def flushed(self):
        """Fraction of nonzero inputs that rounded to zero."""
        return self.flushed_count / self.nonzero if self.nonzero else 0.0

    @property
    def relative_error(self):
        """||q(g) - g|| / ||g||: what this rank's encode changed (0 for zeros; NaN/Inf tensors count 0)."""
        return math.sqrt(self.error_sq / self.norm_sq) if self.norm_sq else 0.0

    def __add__(self, other):
        return TensorStats(other.shift, self.elements + other.elements, self.nonzero + other.nonzero,
                           self.flushed_count + other.flushed_count, self.saturated + other.saturated,
                           self.bytes_in + other.bytes_in, self.bytes_carried + other.bytes_carried,
                           self.finite and other.finite, self.error_sq + other.error_sq,
                           self.norm_sq + other.norm_sq, self.measured + other.measured, other.fmt)

    def __str__(self):
        ratio = self.bytes_carried / self.bytes_in if self.bytes_in else 0.0
        sampled = f" (from {self.measured} sampled elements)" if self.measured < self.elements else ""
        return (f"{self.bytes_in} gradient bytes in, {self.bytes_carried} carried ({ratio:.2f}x), "
                f"{self.flushed:.2%} of nonzero values flushed to zero, {self.saturated} saturated, "
                f"relative encode error {self.relative_error:.3e}{sampled}")

    def row(self, label):
        return [label, self.fmt, self.elements, self.measured, self.shift, f"{self.flushed:.4f}", self.saturated,
                f"{self.relative_error:.4e}", self.bytes_in, self.bytes_carried]


STATS_COLUMNS = ["tensor", "format", "elements", "measured", "shift", "flushed", "saturated", "relative_error",
                 "bytes_in", "bytes_carried"]
STATS_SAMPLE = 1 << 16  # elements per tensor the stats look at by default (a strided sample)


def _adapter(tensor):
    """The framework adapter module for a tensor, or None for anything else."""
    root = type(tensor).__module__.split(".")[0]
    if root not in _ADAPTERS:
        return None
    # __import__, not importlib: TF's autograph traces compress() and warns on importlib's frames
    return __import__(_ADAPTERS[root], fromlist=["compress"])


class APSCompressor:
    """Horovod Compressor that sends gradients in a custom float format with APS.

    Arguments:
        fmt: a FloatFormat or its name ("e4m3", "e5m2", "e3m0", ...).
        rounding, scaling, saturate, wire, bucket_bytes, min_elements, error_feedback,
            chunk_bytes: see hvd_aps.config.APSConfig (defaults: nearest rounding, APS, no
            saturation, codes on the wire, 16 MiB buckets exchanged in pipelined 4 MiB chunks,
            tensors under 4096 elements through Horovod's plain allreduce, no error feedback).
        seed: base of the stochastic-rounding streams (random if None).
        hybrid, hybrid_threshold: hybrid precision (see APSConfig): e.g. hybrid="e4m3" sends the
            tensors a 4-bit format would lose too much of in e4m3.
        stats: record what each tensor went through: `stats[label]` holds the last call per
            tensor label (TF: the gradient's graph name; torch: dtype and shape, so tensors of one
            shape share an entry), `totals()` the sum since `reset_stats()`, `stats_table()` both
            as text or CSV; `bytes_sent` counts the codes exchanges' bytes sent by this rank.
        stats_sample: the error, flushed and saturated figures of a tensor come from an evenly
            strided sample of about this many of its elements, scaled up (0: every element).
            Measured on a 4M-element tensor: every element 12x the encode's time (21 ms
            against 1.7 ms), the default sample half of it (0.8 ms), so stats stay on.

    Every rank must use an equal compressor and hand it the same tensors in the same order: the
    metadata allreduce checks the configuration and every tensor's size, and raises on a mismatch.

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd_aps.APSCompressor(hvd_aps.e4m3))
    """

    def __init__(self, fmt, rounding="nearest", scaling="aps", saturate=False, wire="codes",
                 bucket_bytes=DEFAULT_BUCKET_BYTES, min_elements=DEFAULT_MIN_ELEMENTS, error_feedback=False,
                 hybrid=None, hybrid_threshold=DEFAULT_HYBRID_THRESHOLD, chunk_bytes=DEFAULT_CHUNK_BYTES,
                 seed=None, stats=True, stats_sample=STATS_SAMPLE):
        self.config = APSConfig(fmt, rounding, scaling, saturate, wire, bucket_bytes, min_elements, error_feedback,
                                hybrid, hybrid_threshold, chunk_bytes)
        if not isinstance(stats_sample, int) or stats_sample < 0:
            raise ValueError(f"stats_sample must be an int >= 0, got {stats_sample!r}")
        self.stats_sample = stats_sample
        self._residuals = {}
        self.carrier = np.dtype(np.float16 if self.fmt.fits_float16 else np.float32)
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.collect_stats = stats
        self._calls, self._lock = 0, threading.Lock()
        self._batches = tokens.Batches(self)
        self._stages = {}
        self.reset_stats()

    @property
    def fmt(self):
        return self.config.fmt

    def __repr__(self):
        c = self.config
        return (f"APSCompressor({str(c.fmt)!r}, rounding={c.rounding!r}, scaling={c.scaling!r}, "
                f"saturate={c.saturate}, wire={c.wire!r})")

    # Horovod's Compressor interface -----------------------------------------------------------
    def compress(self, tensor):
        adapter = _adapter(tensor)
        if adapter is None or not adapter.is_dense_float(tensor):
            return tensor, None
        if self.config.wire == "values":
            return adapter.compress_values(tensor, self)
        if adapter.numel(tensor) < self.config.min_elements:  # Horovod's plain allreduce carries it
            n = adapter.numel(tensor)
            self.record(adapter.label(tensor), TensorStats(elements=n, bytes_in=4 * n, bytes_carried=4 * n,
                                                           measured=n, fmt="float32"))
            return tensor, None
        return self._batches.add(adapter, tensor)

    def decompress(self, tensor, ctx):
        if ctx is None:  # passed through, or Horovod's sparse path calling without a context
            return tensor
        if isinstance(ctx, tokens.Ticket):
            return self._batches.result(tensor, ctx)
        return _adapter(tensor).decompress_values(tensor, ctx, self)

    # The numerics, on NumPy/CuPy arrays; adapters and the exchange stages call these -------------
    @property
    def signature(self):
        return self.config.signature

    def metadata(self, amaxes, sizes, errors=()):
        """The float64 vector every rank Max-allreduces: [amax..., size..., -size..., error...,
        signature, -signature]; the Max of x and of -x tells whether all ranks had the same x.
        `errors` (hybrid precision only, one per tensor): the narrow format's sampled relative
        encode error, whose Max over the ranks picks each tensor's format."""
        sizes = np.asarray(sizes, np.float64)
        return np.concatenate([np.asarray(amaxes, np.float64), sizes, -sizes, np.asarray(errors, np.float64),
                               [self.signature, -self.signature]])

    def agreed_amaxes(self, agreed, sizes, labels):
        """From the Max-allreduced metadata to the agreed amaxes, after checking that every rank
        has this configuration and these tensor sizes."""
        agreed, count = np.asarray(agreed, np.float64).ravel(), len(sizes)
        if agreed.size != (3 + self._error_entries) * count + 2:
            raise ValueError(f"metadata of {agreed.size} values for {count} tensors: ranks disagree on the bucket")
        high, neg_low = agreed[-2], agreed[-1]
        if high != -neg_low:
            raise ValueError(f"APSCompressor mismatch across ranks: this rank uses {self!r} (signature "
                             f"{self.signature}) but signatures range from {-neg_low:g} to {high:g}")
        most, least = agreed[count:2 * count], -agreed[2 * count:3 * count]
        for i in np.flatnonzero(most != least):
            raise ValueError(f"ranks handed different tensors to the exchange: tensor {i} ({labels[i]}) has "
                             f"{sizes[i]} elements here and {least[i]:.0f} to {most[i]:.0f} across ranks "
                             "(another model, or gradients in another order)")
        return agreed[:count]

    @property
    def _error_entries(self):
        return int(self.config.hybrid is not None)

    def goes_wide(self, agreed, count):
        """Hybrid precision, from the checked metadata: which tensors go out in the wide format
        (some rank's sampled error over the threshold; NaN counts as over)."""
        if not self._error_entries:
            return np.zeros(count, bool)
        errors = np.asarray(agreed, np.float64).ravel()[3 * count:4 * count]
        return ~(errors <= self.config.hybrid_threshold)

    def next_seed(self, rank):
        """Seed for one stochastic encode: from (seed, rank, call number), so no two ranks or calls
        share random bits."""
        with self._lock:  # exchanges run on several threads
            self._calls += 1
            return hash((self.seed, rank, self._calls)) & ((1 << 64) - 1)

    def stages(self, world, rank):
        """The codes exchange's stages for this rank (buffers kept per bucket name)."""
        with self._lock:
            if (world, rank) not in self._stages:
                self._stages[(world, rank)] = wire.CodesExchange(self, world, rank)
            return self._stages[(world, rank)]

    # Error-feedback residuals: state, saved and restored with the model ------------------------
    def residual(self, key, index, like):
        """The residual of tensor `index` of bucket `key` (zeros the first time, or when the
        bucket's tensors changed, as after DDP rebuilds its buckets)."""
        xp = _arrays.array_module(like)
        with self._lock:
            kept = self._residuals.get((key, index))
            if kept is None or kept.size != like.size:
                kept = self._residuals[(key, index)] = xp.zeros(like.size, xp.float32)
            elif _arrays.array_module(kept) is not xp:  # restored from a checkpoint onto the device
                kept = self._residuals[(key, index)] = xp.asarray(kept)
            return kept

    def state_dict(self):
        """What a checkpoint must hold to resume bit for bit: the error-feedback residuals (as
        NumPy arrays) and the stochastic-rounding counter."""
        with self._lock:
            residuals = {f"{key}#{index}": _arrays.to_numpy(r).copy() for (key, index), r in self._residuals.items()}
            return {"residuals": residuals, "seed": self.seed, "calls": self._calls}

    def load_state_dict(self, state):
        residuals = {}
        for name, kept in state["residuals"].items():
            key, index = name.rsplit("#", 1)
            residuals[(key, int(index))] = np.array(kept, np.float32)
        with self._lock:
            self._residuals, self.seed, self._calls = residuals, int(state["seed"]), int(state["calls"])

    def to_wire(self, x, agreed_amax, world_size, rank, label):
        """wire="values": scale x (NumPy, or CuPy on a GPU) by the agreed APS shift and round it
        onto the grid: (carrier array, shift)."""
        xp = _arrays.array_module(x)
        x = xp.ascontiguousarray(x, dtype=xp.float32)
        cfg, finite = self.config, bool(np.isfinite(agreed_amax))
        # Horovod sums the carrier dtype: the sum needs headroom only within that dtype's range
        sum_max = float(np.finfo(self.carrier).max)
        shift = scaling.shift_for(agreed_amax, world_size, self.fmt, sum_max) if finite and cfg.scaling == "aps" else 0
        if finite:
            wire_values = codec.quantize(x, self.fmt, cfg.rounding, self.next_seed(rank), cfg.saturate, shift,
                                         unscale=False, dtype=self.carrier)
        else:  # unscaled and unrounded: the NaN/Inf reaches every rank's sum
            wire_values = x.astype(self.carrier)
        if self.collect_stats:
            step = _arrays.sample_stride(x.size, self.stats_sample)
            limit = np.float32(np.ldexp(self.fmt.max, -shift)) if finite else None
            self.record(label, _measure(xp, x.ravel()[::step], self.from_wire(wire_values.ravel()[::step], shift),
                                        limit, shift, x.size, wire_values.nbytes, str(self.fmt)))
        return wire_values, shift

    def from_wire(self, wire_values, shift):
        """Undo the shift: float32 values of the summed wire tensor (exact, one rounding at most)."""
        xp = _arrays.array_module(wire_values)
        return xp.ldexp(wire_values.astype(xp.float32), xp.int32(-int(shift))).astype(xp.float32)

    # Stats --------------------------------------------------------------------------------------
    def measure_codes(self, x, row, pos, shift, fmt):
        """TensorStats of float32 values x the codes exchange encoded into codes pos .. pos +
        x.size of the packed stream `row` in `fmt` (row None: they held NaN/Inf); None when stats
        are off. Only the sampled codes are read."""
        if not self.collect_stats:
            return None
        xp = _arrays.array_module(x)
        if row is None:
            return TensorStats(elements=x.size, bytes_in=4 * x.size, finite=False, fmt=str(fmt))
        step = _arrays.sample_stride(x.size, self.stats_sample)
        sent = codec.decode(codec.codes_at(row, fmt, xp.arange(pos, pos + x.size, step)), fmt, shift)
        return _measure(xp, x.ravel()[::step], sent, np.float32(np.ldexp(fmt.max, -shift)), shift, x.size,
                        codec.packed_size(x.size, fmt), str(fmt))

    def record(self, label, stats):
        if not self.collect_stats or stats is None:
            return
        with self._lock:
            self.stats[label] = stats
            self._total = self._total + stats

    def record_sent(self, nbytes):
        with self._lock:
            self.bytes_sent += nbytes

    def totals(self):
        """TensorStats summed over every tensor since reset_stats()."""
        return self._total

    def stats_table(self, csv=False):
        """The last stats of every tensor label as an aligned table, or CSV with a header."""
        with self._lock:
            rows = [stats.row(label) for label, stats in self.stats.items()]
        cells = [STATS_COLUMNS] + [[str(c) for c in row] for row in rows]
        if csv:
            return "\n".join(",".join(row) for row in cells) + "\n"
        widths = [max(len(row[i]) for row in cells) for i in range(len(STATS_COLUMNS))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells) + "\n"

    def reset_stats(self):
        self.stats, self._total, self.bytes_sent = {}, TensorStats(), 0


def _measure(xp, x, sent, limit, shift, elements, bytes_carried, fmt):
    """TensorStats of a tensor of `elements` float32 values from x (all of them, or a sample)
    against the values sent for x, unscaled; counts and sums scaled up to the whole tensor
    (limit None: it held NaN/Inf and went unscaled, so there is no error to speak of)."""
    scale, finite = elements / x.size if x.size else 1.0, limit is not None
    nonzero = int(xp.count_nonzero(x))
    saturated = int(xp.count_nonzero((x > limit) | (x < -limit))) if finite else 0
    x64 = x.astype(xp.float64)
    diff = sent.astype(xp.float64) - x64
    return TensorStats(shift=shift, elements=elements, nonzero=round(nonzero * scale),
                       flushed_count=round((nonzero - int(xp.count_nonzero(sent))) * scale),
                       saturated=round(saturated * scale), bytes_in=4 * elements, bytes_carried=bytes_carried,
                       finite=finite, error_sq=float(xp.dot(diff, diff)) * scale if finite else 0.0,
                       norm_sq=float(xp.dot(x64, x64)) * scale if finite else 0.0, measured=x.size, fmt=fmt)


def from_name(name, stock, **options):
    """A compressor from a command-line name, as the examples and the studies spell them
    (`options`: further APSCompressor keywords, e.g. hybrid_threshold).

    "none" and "fp16": Horovod's own (`stock` is the framework's horovod Compression namespace);
    "aps-<format>": APSCompressor(format), codes on the wire through Horovod's own optimizer;
    "naive-<format>": the same with scaling="none"; a "-values" suffix sends wire="values"
    (float16 carrier) instead of codes, "-ef" turns error feedback on, "-hybrid" hybrid precision
    with HYBRID_FORMAT as the wide format; "codes-<format>": the compressor of "aps-<format>",
    for hvd_aps.torch.DistributedOptimizer (the examples pick that optimizer by this prefix).
    """
    if name in ("none", "fp16"):
        return getattr(stock, name)
    parts = name.split("-")
    suffixes = {"values": False, "ef": False, "hybrid": False}
    while parts and parts[-1] in suffixes:
        suffixes[parts.pop()] = True
    if len(parts) != 2 or parts[0] not in _NAMED_SCALINGS:
        raise ValueError(f"unknown compression {name!r}: use none, fp16, aps-<format> or naive-<format>, "
                         "optionally ending in -values, -ef and/or -hybrid")
    return APSCompressor(parts[1], scaling=_NAMED_SCALINGS[parts[0]], wire="values" if suffixes["values"] else "codes",
                         error_feedback=suffixes["ef"], hybrid=HYBRID_FORMAT if suffixes["hybrid"] else None, **options)


_NAMED_SCALINGS = {"aps": "aps", "codes": "aps", "naive": "none"}
HYBRID_FORMAT = "e4m3"  # the wide format of from_name's "-hybrid" settings
