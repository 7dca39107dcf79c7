"""Codes through Horovod's own allreduce: the framework adapters, and the token Horovod reduces.

Horovod allreduces what compress(t) returns and hands the result to decompress(). So compress()
puts the gradient in a batch (hvd_aps._batches) and returns a token, [1, rank]. The token, reduced
as the gradient would be, says what to do with the sum ([c N, c N (N-1) / 2]: c = 1/N an average,
1 a sum); Adasum, Min, Max and Product are refused. It comes back too late to fold an average into
the decode, so a batch averages where its name's tokens said Average the step before (a step whose
tokens then disagree raises). One Horovod optimizer owns a compressor. Adapters:
hvd_aps.torch.adapter, hvd_aps.tensorflow.adapter; see docs/how-it-works.md.
"""
import dataclasses
import functools
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from . import exchange
from .config import Fallback, Path, Policy

# The token's reduced value is 1 or N up to a few float32 roundings of the scale factors.
TOKEN_TOLERANCE = 1e-4
NOT_A_SUM = ("APSCompressor's codes need an allreduce that sums (op Average or Sum, with any pre/postscale); this "
             "reduction is not one (Adasum, Min, Max or Product?): use APSCompressor(..., wire='values') for it")
NOT_AVERAGED = ("APSCompressor averaged these sums as the same gradients' allreduce did in the step before, and "
                "this allreduce does not average (op Sum or other pre/postscale factors): this step is abandoned "
                "on every rank and the next one runs as this op asks. Use one APSCompressor for each reduction.")
ADAPTERS = {"torch": "hvd_aps.torch.adapter", "tensorflow": "hvd_aps.tensorflow.adapter"}


@runtime_checkable
class Adapter(Protocol):
    """What the Horovod path needs of a framework: conversions between its tensors and the
    codec's arrays, its collectives as exchange.Levels, and where its exchanges run. Each of
    hvd_aps.torch.adapter and hvd_aps.tensorflow.adapter is a module of these functions."""

    threaded: bool  # exchanges run on the exchanger's threads (eager torch, so backward goes on)

    def is_dense_float(self, tensor) -> bool: ...

    def is_empty(self, tensor) -> bool: ...

    def numel(self, tensor) -> int: ...

    def label(self, tensor) -> str:
        """The tensor's name in the stats."""

    def flatten(self, tensor):
        """The gradient as a float32 flat array (a graph tensor in a graph)."""

    def join(self, flats):
        """flatten()'s arrays end to end in one flat array: a batch's bucket."""

    def place(self, tensor):
        """Where a threaded exchange of this gradient runs (hvd_aps._device.Place), None: anywhere."""

    def token(self, tensor, process_set):
        """What Horovod allreduces in place of a gradient sent as codes (token_values)."""

    def call_site(self, frame):
        """The hvd_aps._horovod.Site of a compress() whose caller is `frame` (its key None where
        the framework's gradients go in the order they arrive: TensorFlow, whose graph fixes its
        exchanges when traced)."""

    def world(self, process_set) -> int:
        """The ranks Horovod's allreduce spans on the process set."""

    def levels(self, hierarchical, process_set, timeout: float) -> exchange.Levels:
        """The exchange's groups on the process set, each wait for the other ranks bounded by
        `timeout` seconds where the framework can bound it (collective on first use)."""


    def forget_groups(self) -> None: ...

    def finish(self, total, token_out, like, reduction: "Reduction", ranks: int):
        """The exchanged sum `total` (float32 flat) over `ranks` ranks as Horovod's op left
        `token_out`, in the gradient's shape and dtype (apply_op: with `reduction` where the op
        is known now; or, where the batch averaged already, the token left in reduction.unread
        for the step's end to check)."""

    def read_tokens(self, tokens: list) -> list:
        """The reduced tokens' values on the host, in one read (where finish leaves any unread)."""

    def at_step_end(self, out, end_step, results):
        """`out` (the step's last result) once `end_step` ran after every one of `results`."""

    def native_wire(self, tensor, fallback):
        """The tensor in the dtype the framework's allreduce carries it in."""

    def carries_bfloat16(self, tensor) -> bool:
        """Whether the framework's allreduce takes this tensor in bfloat16."""

    def native_result(self, reduced, like): ...

    def compress_values(self, tensor, exchanger, process_set) -> tuple:
        """wire="values": (what Horovod allreduces, decompress_values' context)."""

    def decompress_values(self, tensor, ctx, exchanger): ...


@runtime_checkable
class LayoutAdapter(Adapter, Protocol):
    """An adapter whose call_site gives keys (horovod.torch): what the agreed layouts need too."""

    def tokens(self, like, process_set, count) -> list:
        """`count` tokens made at once (a step's tokens of a layout's gradients)."""

    def gather(self, obj, process_set, name, timeout: float) -> list:
        """Every rank's picklable `obj`, in rank order (eagerly: the layout's agreement), waited
        for `timeout` seconds at most."""

    def zeros(self, like, count):
        """`count` float32 zeros where `like` lies: a gradient a rank did not hand over."""


def adapter_of(tensor) -> "Adapter | None":
    """The framework adapter for a tensor, or None for anything else (found once per tensor type:
    every gradient of every step asks, on the thread backward runs on)."""
    return _adapter_of_type(type(tensor))


@functools.lru_cache(maxsize=None)
def _adapter_of_type(kind: type):
    root = kind.__module__.split(".")[0]
    # __import__, not importlib: TF's autograph traces compress() and warns on importlib's frames
    return __import__(ADAPTERS[root], fromlist=["compress"]) if root in ADAPTERS else None


@dataclasses.dataclass
class Reduction:
    """Whether a batch's exchange averaged its sums (learned from the batch of the same name in
    the step before), for each of its tokens whether it said Average, and the tokens of an
    averaged batch not read yet (`unread`: (token, ranks), checked when the step ends)."""
    averaged: bool = False
    said_average: list = dataclasses.field(default_factory=list)
    unread: list = dataclasses.field(default_factory=list)

    def all_average(self) -> bool:
        """Every token said Average (and one came): the next step's batch of this name averages."""
        return bool(self.said_average) and all(self.said_average)


def check_fallback(config, adapter: Adapter, tensor) -> None:
    """Refuse a fallback Horovod's allreduce cannot carry at the first exchange, not after the
    trials, when policy="auto" first sends a step that way."""
    if config.policy is Policy.AUTO and config.fallback is Fallback.BFLOAT16 and not adapter.carries_bfloat16(tensor):
        raise ValueError("APSCompressor(policy='auto', fallback='bfloat16'): Horovod's own allreduce does not "
                         "carry bfloat16 here (horovod.torch only for CUDA tensors on NCCL, horovod.tensorflow "
                         "never): use fallback='float16' or 'float32', or bfloat16 with the DDP hook or FSDP2")


def pass_through(adapter: Adapter, tensor, exchanger) -> tuple:
    """A tensor too small for codes: the framework's plain allreduce carries it, in float32 as
    the codes' tokens are (Horovod's grouped allreduce takes one dtype, its Gloo no bfloat16),
    and decompress() gives it back in its dtype -> (wire, Cast context)."""
    exchanger.pass_through(adapter.label(tensor), adapter.numel(tensor))
    return adapter.native_wire(tensor, Path.FLOAT32), Cast(tensor)


class Cast:
    """decompress()'s context for a gradient too small for codes that went through the
    framework's allreduce in float32: `like` holds the dtype it comes back in."""

    def __init__(self, like):
        self.like = like


def _said(token, world: int, reduction: Optional[Reduction]) -> tuple:
    """(scale, whether it is an average) of a reduced token, checked to be a sum of tokens and,
    where the batch averaged already, an average; recorded in `reduction`."""
    scale = float(token[0])
    summed, average = _read(scale, float(token[1]), world)
    if not summed:
        raise ValueError(NOT_A_SUM)
    average = bool(average)
    if reduction is not None:
        reduction.said_average.append(average)
        if reduction.averaged and not average:
            raise RuntimeError(NOT_AVERAGED)
    return scale, average


def _read(scale, ranks, world):
    """(whether it is a sum of tokens, whether an average) of reduced tokens [scale, ranks] over
    `world` ranks: floats, or NumPy arrays of a step's tokens checked at once."""
    summed = np.abs(ranks - scale * (world - 1) / 2) <= TOKEN_TOLERANCE * np.maximum(1.0, np.abs(scale) * world * world)
    return summed, np.abs(scale - 1.0) <= TOKEN_TOLERANCE


def check_unread(launched: list) -> None:
    """The step's tokens left unread (averaged batches: their results needed none), read in one
    go and checked at once as _said checks each: on a device, one read a step instead of one a
    gradient, and no Python per token but the record of what it said."""
    for adapter in {batch.adapter for batch in launched if batch.reduction.unread}:
        batches = [batch for batch in launched if batch.adapter is adapter]
        unread = [(batch.reduction, ranks) for batch in batches for _, ranks in batch.reduction.unread]
        values = np.asarray(adapter.read_tokens([token for batch in batches for token, _ in batch.reduction.unread]),
                            np.float64).reshape(len(unread), 2)
        summed, average = _read(values[:, 0], values[:, 1], np.array([ranks for _, ranks in unread], np.float64))
        if not summed.all():
            raise ValueError(NOT_A_SUM)
        for (reduction, _), said in zip(unread, average.tolist()):
            reduction.said_average.append(said)
        if not average.all():  # only an averaged batch leaves its tokens unread (Adapter.finish)
            raise RuntimeError(NOT_AVERAGED)


def token_values(rank: int) -> np.ndarray:
    """What compress() hands Horovod to reduce in place of the gradient."""
    return np.array([1.0, rank], np.float32)


def apply_op(total, token, world: int, reduction: Optional[Reduction] = None):
    """The exchanged sum (NumPy/CuPy float32, changed in place) as Horovod's reduction would have
    left it, from the reduced token: average (divided by N in float32, as every codes path
    divides), sum, or sum times the factor Horovod applied. With `reduction`, what the token says
    is recorded there, and sums its exchange already averaged come back as they are."""
    scale, average = _said(token, world, reduction)
    if reduction is not None and reduction.averaged:
        return total
    if average:
        total /= np.float32(world)
    elif abs(scale - world) > TOKEN_TOLERANCE * world:
        total *= np.float32(scale / world)
    return total
