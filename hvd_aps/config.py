"""What an APSCompressor is configured with: one frozen value, validated in one place, and the
named recipes the examples and studies use.

Configuration is kept apart from state (residuals, step counts, the schedule, stats, buffers), as
torchao's float8 config is: every rank must build an equal APSConfig, and the exchange checks
that through `signature`.
"""
import contextlib
import dataclasses
import hashlib
import math
from typing import Optional, Union

from ._choice import Choice
from .formats import FloatFormat


class Rounding(Choice):
    NEAREST = "nearest"        # to nearest, ties to the even code
    STOCHASTIC = "stochastic"  # up with probability equal to the discarded fraction


class Scaling(Choice):
    APS = "aps"    # Auto-Precision Scaling
    NONE = "none"  # the naive cast, for comparison


class Wire(Choice):
    CODES = "codes"    # the format's codes themselves, through an alltoall/allgather exchange
    VALUES = "values"  # values on the format's grid, carried by the framework's allreduce in float16


class Policy(Choice):
    CODES = "codes"  # every bucket sends codes
    AUTO = "auto"    # whole steps timed both ways; every bucket sends codes only if their steps are clearly shorter


class Fallback(Choice):
    """What policy="auto" sends where codes do not pay: the framework's allreduce in one dtype,
    or AUTO: in float32 or float16, whichever steps are faster."""
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    AUTO = "auto"


class Path(Choice):
    """What a step sends every bucket in: the format's codes, or the framework's own allreduce
    in one dtype (policy="auto"'s paths: the schedule's, the native hooks' and the stats' keys)."""
    CODES = "codes"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def native(self) -> bool:
        return self is not Path.CODES

    @property
    def itemsize(self) -> int:
        """Bytes of one element on a native path's allreduce."""
        if not self.native:
            raise ValueError("codes have no fixed element size: it is the format's")
        return 4 if self is Path.FLOAT32 else 2


NATIVE_PATHS = tuple(path for path in Path if path.native)  # the more exact first


class Tuned(Choice):
    AUTO = "auto"  # chunk_bytes chosen at run time from the steps' times


AUTO = Tuned.AUTO
DEFAULT_BUCKET_BYTES = 16 << 20  # float32 gradient bytes fused into one codes exchange
DEFAULT_MIN_ELEMENTS = 4096      # smaller tensors take the framework's plain allreduce on the codes path
DEFAULT_HYBRID_THRESHOLD = 0.75  # sampled elementwise relative error above which a tensor goes wide
# chunk_bytes="auto" tries these (float32 bytes per chunk; 0: the whole bucket at once). Chunks
# pay where the wire is slower than the codec (1 Gbit/s); unchunked wins where it is faster.
CHUNK_CANDIDATES = (0, 4 << 20, 1 << 20)
# Where the schedule cannot be tuned (inside a TF graph, whose chunks are fixed when it is traced):
GRAPH_CHUNK_BYTES = 4 << 20
# Seconds a rank waits for the others in one collective before it raises: torch.distributed's
# default process-group timeout, so that only ranks that will never answer trip it
DEFAULT_TIMEOUT = 1800.0


@dataclasses.dataclass(frozen=True)
class APSConfig:
    """How gradients are compressed.

    Attributes:
        fmt: a FloatFormat or its name ("e4m3", "e5m2", "e3m0", ...).
        rounding: Rounding.NEAREST (ties to even) or STOCHASTIC (seeded per rank, tensor, step
            and element: the same seed gives the same bits on every run).
        scaling: Scaling.APS (Auto-Precision Scaling) or NONE (the naive cast).
        saturate: clamp finite overflow to +-max instead of Inf/NaN.
        wire: Wire.CODES sends the format's codes (1 byte per element for 8-bit formats, packed
            below 8 bits) through an alltoall/allgather exchange; VALUES rounds onto the grid and
            lets the framework's allreduce carry the values in float16 (float32 for formats
            float16 cannot hold): 2x less than fp32 at most.
        bucket_bytes: float32 gradient bytes fused into one codes exchange.
        min_elements: through Horovod (its optimizers and allreduce, hvd_aps.torch's optimizer),
            smaller tensors take the framework's plain allreduce; the DDP hook and FSDP exchange
            the buckets and rows the framework hands them whole.
        error_feedback: on the codes path, each rank adds what the last step's encode lost (its
            residual) to the gradient before encoding, and each range's owner does the same for
            its re-encode of the sum (1-bit SGD, EF-SGD, two-sided); residuals are state.
        hybrid: None, or a wider format (codes path): a tensor goes out in it instead of `fmt`
            when the mean elementwise relative error abs(q(g) - g) / abs(g) (1 for an entry flushed to
            zero) that `fmt` makes on a sample of it exceeds hybrid_threshold on some rank. 4-bit
            formats make 0.27-0.35 on Gaussian gradients and 0.55-1 on heavy-tailed ones.
        chunk_bytes: a bucket's exchange runs in chunks of this many float32 bytes, one encoded
            while the one before travels (0: the whole bucket at once), or "auto": chosen per
            bucket from the times of whole steps at each (CHUNK_CANDIDATES). Pure scheduling: the
            results are the same bits whatever it is.
        hierarchical: None picks two levels (float32 inside a host, codes between hosts) where
            several hosts each hold several ranks, flat codes otherwise; True / False force it.
        policy: Policy.CODES always sends codes; AUTO times whole steps with codes and with the
            framework's own allreduce (in `fallback`) and sends every bucket the faster way
            (codes only if clearly faster). AUTO changes what is sent, so it is opt-in; its
            decision is in state_dict(), so a resumed run keeps it.
        fallback: the dtype policy="auto" sends in (float32, or float16 / bfloat16 where the
            user allows the 16-bit cast), or "auto": float32 and float16 are both timed (or
            predicted) and the faster kept; float16's range ends at 65504, so gradients larger
            than that (before averaging) overflow on that path as with any float16 allreduce.
        timeout: seconds a rank waits for the other ranks in one collective of the codes path
            through horovod.torch (the buckets' agreement, the metadata allreduce, the codes'
            alltoall and allgather, the host's shared memory) before it raises TimeoutError
            naming the collective and the process set: ranks that disagree (another model,
            another process set) fail instead of waiting for ever. The DDP hook's own process
            groups are made with it too. The default is torch.distributed's process-group
            timeout, so a slow link never trips it.
    """

    fmt: FloatFormat
    rounding: Rounding = Rounding.NEAREST
    scaling: Scaling = Scaling.APS
    saturate: bool = False
    wire: Wire = Wire.CODES
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_elements: int = DEFAULT_MIN_ELEMENTS
    error_feedback: bool = False
    hybrid: Optional[FloatFormat] = None
    hybrid_threshold: float = DEFAULT_HYBRID_THRESHOLD
    chunk_bytes: Union[int, Tuned] = AUTO
    hierarchical: Optional[bool] = None
    policy: Policy = Policy.CODES
    fallback: Fallback = Fallback.FLOAT32
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self):
        object.__setattr__(self, "fmt", FloatFormat.parse(self.fmt))
        for field, choice in (("rounding", Rounding), ("scaling", Scaling), ("wire", Wire), ("policy", Policy),
                              ("fallback", Fallback)):
            object.__setattr__(self, field, choice.parse(getattr(self, field), field))
        if isinstance(self.chunk_bytes, str) and not isinstance(self.chunk_bytes, Tuned):
            with contextlib.suppress(ValueError):  # other text fails the int check below
                object.__setattr__(self, "chunk_bytes", Tuned(self.chunk_bytes))
        if self.hybrid is not None:
            object.__setattr__(self, "hybrid", FloatFormat.parse(self.hybrid))
            if self.hybrid.bits <= self.fmt.bits:
                raise ValueError(f"hybrid must be a wider format than {self.fmt}, got {self.hybrid}")
        if not isinstance(self.hybrid_threshold, (int, float)) or not 0 < self.hybrid_threshold <= 1:
            raise ValueError(f"hybrid_threshold must be a number in (0, 1], got {self.hybrid_threshold!r}")
        for field in ("saturate", "error_feedback"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.hierarchical not in (None, True, False):
            raise TypeError(f"hierarchical must be None, True or False, got {self.hierarchical!r}")
        for field in ("error_feedback", "hybrid"):
            if getattr(self, field) and self.wire is not Wire.CODES:
                raise ValueError(f"{field} needs wire='codes': the framework's allreduce of values carries one "
                                 "format and keeps no residual")
        for field in ("bucket_bytes", "min_elements") + (() if self.chunk_bytes is AUTO else ("chunk_bytes",)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an int >= 0{' or auto' if field == 'chunk_bytes' else ''}, "
                                 f"got {value!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or \
                not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")

    @property
    def candidates(self) -> tuple:
        """The chunkings a bucket may run (hvd_aps._schedule)."""
        return CHUNK_CANDIDATES if self.chunk_bytes is AUTO else (self.chunk_bytes,)

    @property
    def natives(self) -> tuple:
        """The native Paths policy="auto" weighs against codes (the more exact first)."""
        if self.fallback is Fallback.AUTO:
            return (Path.FLOAT32, Path.FLOAT16)
        return (Path(self.fallback.value),)

    @property
    def graph_chunk_bytes(self) -> int:
        """The chunking of an exchange inside a graph, fixed when it is traced."""
        return GRAPH_CHUNK_BYTES if self.chunk_bytes is AUTO else self.chunk_bytes

    def settings(self) -> dict:
        """Every field as text, by name: what `signature` hashes, and what ranks whose signatures
        differ gather to name the fields that differ (hvd_aps._metadata.settings_differ)."""
        return {f.name: f"{getattr(self, f.name)}" for f in dataclasses.fields(self)}

    @property
    def signature(self) -> int:
        """An integer naming the whole configuration: equal on every rank or the exchange raises.
        48 bits of a hash of every field, so it rides exactly in the float64 metadata vector
        (two configurations share it with probability 2**-48)."""
        fields = ",".join(f"{name}={text}" for name, text in self.settings().items())
        return int.from_bytes(hashlib.blake2b(fields.encode(), digest_size=6).digest(), "little")


# Named recipes (torchao's pattern): the settings the examples and studies compare, by name.
RECIPES = {
    "aps-e4m3": dict(fmt="e4m3"),
    "aps-e5m2": dict(fmt="e5m2"),
    "aps-e3m0": dict(fmt="e3m0"),
    "aps-e2m1fn": dict(fmt="e2m1fn"),
    "aps-e4m3-ef": dict(fmt="e4m3", error_feedback=True),
    "aps-e5m2-ef": dict(fmt="e5m2", error_feedback=True),
    "aps-e3m0-ef": dict(fmt="e3m0", error_feedback=True),
    "aps-e2m1fn-ef": dict(fmt="e2m1fn", error_feedback=True),
    "aps-e3m0-hybrid": dict(fmt="e3m0", hybrid="e4m3"),
    "aps-e2m1fn-hybrid": dict(fmt="e2m1fn", hybrid="e4m3"),
    "aps-e2m1fn-ef-hybrid": dict(fmt="e2m1fn", error_feedback=True, hybrid="e4m3"),
    "aps-e4m3-values": dict(fmt="e4m3", wire="values"),
    "aps-e5m2-values": dict(fmt="e5m2", wire="values"),
    "aps-e3m0-values": dict(fmt="e3m0", wire="values"),
    "aps-e4m3-auto": dict(fmt="e4m3", policy="auto"),
    "aps-e3m0-auto": dict(fmt="e3m0", policy="auto"),
    "aps-e4m3-auto16": dict(fmt="e4m3", policy="auto", fallback="float16"),
    "aps-e3m0-auto16": dict(fmt="e3m0", policy="auto", fallback="float16"),
    "aps-e4m3-autofb": dict(fmt="e4m3", policy="auto", fallback="auto"),
    "aps-e3m0-autofb": dict(fmt="e3m0", policy="auto", fallback="auto"),
    "naive-e4m3": dict(fmt="e4m3", scaling="none"),
    "naive-e5m2": dict(fmt="e5m2", scaling="none"),
    "naive-e3m0": dict(fmt="e3m0", scaling="none"),
}


def recipe(name: str, **overrides) -> APSConfig:
    """The APSConfig of a named recipe (RECIPES), with keyword overrides."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}: one of {sorted(RECIPES)}")
    return APSConfig(**{**RECIPES[name], **overrides})
