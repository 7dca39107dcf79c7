"""What an APSCompressor is configured with: one frozen value, validated in one place.

Configuration is kept apart from state (seeds, stats, buffers), as torchao's float8 config is:
every rank must build an equal APSConfig, and the exchange checks that through `signature`.
"""
import dataclasses
import hashlib

from .formats import FloatFormat

ROUNDINGS = ("nearest", "stochastic")
SCALINGS = ("aps", "none")  # "none": the naive cast, for comparison
WIRES = ("codes", "values")
DEFAULT_BUCKET_BYTES = 16 << 20  # float32 gradient bytes fused into one codes exchange
DEFAULT_MIN_ELEMENTS = 4096      # smaller tensors take Horovod's plain allreduce on the codes path
DEFAULT_CHUNK_BYTES = 4 << 20  # float32 gradient bytes per pipelined chunk of a bucket
DEFAULT_HYBRID_THRESHOLD = 0.75  # sampled elementwise relative error above which a tensor goes wide


@dataclasses.dataclass(frozen=True)
class APSConfig:
    """How gradients are compressed.

    fmt: a FloatFormat or its name ("e4m3", "e5m2", "e3m0", ...).
    rounding: "nearest" (ties to even) or "stochastic" (seeded per rank and call).
    scaling: "aps" (Auto-Precision Scaling) or "none" (the naive cast).
    saturate: clamp finite overflow to +-max instead of Inf/NaN.
    wire: "codes" sends the format's codes themselves (1 byte per element for 8-bit formats,
    packed below 8 bits) through an alltoall/allgather exchange; "values" rounds onto the grid
    and lets Horovod's own allreduce carry the values in float16 (float32 for formats float16
    cannot hold): 2x less than fp32 at most.
    bucket_bytes: float32 gradient bytes fused into one codes exchange.
    min_elements: on the codes path, smaller tensors take the framework's plain allreduce.
    error_feedback: on the codes path, each rank adds what the last step's encode lost (its
    residual) to the gradient before encoding, and each shard's owner does the same for its
    re-encode of the sum, so rounding errors are carried forward instead of dropped (1-bit SGD,
    EF-SGD, two-sided); the residuals are state (APSCompressor.state_dict).
    hybrid: None, or a wider format (codes path): a tensor goes out in it instead of `fmt` when
    the mean elementwise relative error |q(g) - g| / |g| (1 for an entry flushed to zero) that
    `fmt` would make on a sample of it exceeds hybrid_threshold on some rank (the estimates ride
    on the metadata Max-allreduce, so every rank picks alike). 4-bit formats make 0.27-0.35 on
    Gaussian gradients and 0.55-1 on heavy-tailed ones, whose small entries flush to zero.
    chunk_bytes: a bucket's exchange runs in chunks of this many float32 gradient bytes, one
    encoded while the one before travels and the one before that is decoded (0: the whole
    bucket at once). Each chunk's shards carry their own re-encode exponents, so the numbers
    depend on it: every rank must use the same (the signature covers it). Chunks pay where the
    wire is slower than the codec (1 Gbit/s: 0.22 s a step pipelined, 0.34 s not, README); on
    faster links (10 Gbit/s with one core per rank) their extra collective rounds cost more than
    the overlap, and 0 is as fast or faster.
    """

    fmt: FloatFormat
    rounding: str = "nearest"
    scaling: str = "aps"
    saturate: bool = False
    wire: str = "codes"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_elements: int = DEFAULT_MIN_ELEMENTS
    error_feedback: bool = False
    hybrid: FloatFormat = None
    hybrid_threshold: float = DEFAULT_HYBRID_THRESHOLD
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self):
        object.__setattr__(self, "fmt", FloatFormat.parse(self.fmt))
        if self.hybrid is not None:
            object.__setattr__(self, "hybrid", FloatFormat.parse(self.hybrid))
            if self.hybrid.bits <= self.fmt.bits:
                raise ValueError(f"hybrid must be a wider format than {self.fmt}, got {self.hybrid}")
        if not isinstance(self.hybrid_threshold, (int, float)) or not 0 < self.hybrid_threshold <= 1:
            raise ValueError(f"hybrid_threshold must be a number in (0, 1], got {self.hybrid_threshold!r}")
        for field, allowed in (("rounding", ROUNDINGS), ("scaling", SCALINGS), ("wire", WIRES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        for field in ("saturate", "error_feedback"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {getattr(self, field)!r}")
        for field in ("error_feedback", "hybrid"):
            if getattr(self, field) and self.wire != "codes":
                raise ValueError(f"{field} needs wire='codes': Horovod's own allreduce of values carries one format "
                                 "and keeps no residual")
        for field in ("bucket_bytes", "min_elements", "chunk_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an int >= 0, got {value!r}")

    @property
    def signature(self):
        """An integer naming the whole configuration: equal on every rank or the exchange raises.
        48 bits of a hash of every field, so it rides exactly in the float64 metadata vector
        (two configurations share it with probability 2**-48)."""
        fields = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return int.from_bytes(hashlib.blake2b(fields.encode(), digest_size=6).digest(), "little")
