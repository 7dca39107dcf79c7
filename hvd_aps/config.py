"""What an APSCompressor is configured with: one frozen value, validated in one place.

Configuration is kept apart from state (seeds, stats, buffers), as torchao's float8 config is:
every rank must build an equal APSConfig, and the exchange checks that through `signature`.
"""
import dataclasses

from .formats import FloatFormat

ROUNDINGS = ("nearest", "stochastic")
SCALINGS = ("aps", "none")  # "none": the naive cast, for comparison
WIRES = ("codes", "values")
DEFAULT_BUCKET_BYTES = 16 << 20  # float32 gradient bytes fused into one codes exchange
DEFAULT_MIN_ELEMENTS = 4096      # smaller tensors take Horovod's plain allreduce on the codes path


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
    """

    fmt: FloatFormat
    rounding: str = "nearest"
    scaling: str = "aps"
    saturate: bool = False
    wire: str = "codes"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_elements: int = DEFAULT_MIN_ELEMENTS
    error_feedback: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fmt", FloatFormat.parse(self.fmt))
        for field, allowed in (("rounding", ROUNDINGS), ("scaling", SCALINGS), ("wire", WIRES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        for field in ("saturate", "error_feedback"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.error_feedback and self.wire != "codes":
            raise ValueError("error_feedback needs wire='codes': Horovod's own allreduce of values keeps no residual")
        for field in ("bucket_bytes", "min_elements"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an int >= 0, got {value!r}")

    @property
    def signature(self):
        """A small integer naming everything that changes the numbers: equal on every rank or the
        exchange raises. Exactly representable in float32, so it rides in the metadata vector."""
        f = self.fmt
        code = ((f.exp_bits * 32 + f.man_bits) * 2 + (f.variant == "fn")) * 2 + (self.rounding == "stochastic")
        return ((code * 2 + (self.scaling == "aps")) * 2 + self.saturate) * 2 + self.error_feedback
