"""Codes through Horovod's own allreduce: batches of gradients, and the token Horovod reduces.

Horovod calls compress(t) on every gradient, allreduces what it returns and hands the result to
decompress(): torch's optimizer ends with `p.grad.set_(decompress(output, ctx))`, TF's allreduce
is `decompress(_allreduce(compress(t)), ctx)`, and grouped allreduces compress every tensor first.
So compress() adds the gradient to the open *batch* and returns a one-element token of 1.0. A
batch's codes exchange (hvd_aps.exchange, handed to the exchanger) starts once it holds
bucket_bytes of gradients (torch: on the exchanger's threads, while backward goes on) or at the
first decompress() that needs it.

Horovod reduces the token with the op and the pre/postscale factors it applies to a gradient
(`gradient_predivide_factor`, Average's 1/N), so its value tells decompress() what to do with the
exchanged sum. The token is [1, rank]: a scaled sum gives [c N, c N (N-1) / 2], and c = 1/N means
average, c = 1 sum, anything else that factor; a reduction that is no scaled sum (Adasum, Min,
Max, Product) breaks the ratio and is refused with an error instead of returning wrong numbers.

The token comes back after the exchange, too late to fold an average's division into the decode
tables as the codes optimizer and the DDP hook do (the same float32 division of the same decoded
value, one rounding: the same bits, without a pass of its own over every sum on the thread that
steps). So a batch learns it from the step before: where every token of the batch of its name
said Average there, its exchange averages (`Reduction`). Horovod's optimizers reduce with one op
for their whole life, so that guess holds; where a token then says otherwise (the same
compressor used with another op), the averaged sums cannot give that reduction's bits: the step
raises on every rank and is abandoned as after any error, and the next runs undivided again.
TensorFlow's adapter never learns: a graph fixes its exchanges when it is traced.

A step is every batch handed out until each of its gradients came back through decompress():
then the step ends (hvd_aps.exchanger: it commits residuals, step counts, the schedule's
timings) and the next step names its batches hvd_aps.0, hvd_aps.1, ... again, so names repeat
from step to step (Horovod's response cache, reused buffers) and match across ranks that hand
compress() the same tensors in the same order (the metadata allreduce catches ranks that do
not). A step whose exchange raises is abandoned: nothing it did is kept, its other gradients'
decompress() raise too, and the next compress() starts a fresh step with the same names.
With policy="auto", a batch whose schedule settled on the framework's own allreduce is not
batched at all: its gradients go back to Horovod as they are (or cast to the fallback dtype),
counted in the stats and bytes as every native exchange is (Exchanger.count_native).

The frameworks come in through adapters (Adapter, declared below): hvd_aps.torch.adapter and
hvd_aps.tensorflow.adapter, chosen by the tensor's type.
"""
import contextlib
import dataclasses
import functools
import threading
import warnings
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from . import exchange
from ._schedule import NATIVE_BYTES
from ._stages import Bucket
from .config import Fallback, Policy

# The token's reduced value is 1 or N up to a few float32 roundings of the scale factors.
TOKEN_TOLERANCE = 1e-4
NOT_A_SUM = ("APSCompressor's codes need an allreduce that sums (op Average or Sum, with any pre/postscale); this "
             "reduction is not one (Adasum, Min, Max or Product?): use APSCompressor(..., wire='values') for it")
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

    def token(self, tensor):
        """What Horovod allreduces in place of a gradient sent as codes (token_values)."""

    def world(self) -> int:
        """The ranks Horovod's allreduce spans."""

    def levels(self, hierarchical) -> exchange.Levels:
        """The exchange's groups in this job (collective on first use)."""

    def forget_groups(self) -> None: ...

    def finish(self, total, token_out, like, reduction: "Reduction"):
        """The exchanged sum `total` (float32 flat) as Horovod's op left `token_out`, in the
        gradient's shape and dtype (apply_op: with `reduction` where the op is known now)."""

    def at_step_end(self, out, end_step, results):
        """`out` (the step's last result) once `end_step` ran after every one of `results`."""

    def native_wire(self, tensor, fallback):
        """The tensor in the dtype the framework's allreduce carries it in."""

    def carries_bfloat16(self, tensor) -> bool:
        """Whether the framework's allreduce takes this tensor in bfloat16."""

    def native_result(self, reduced, like): ...

    def compress_values(self, tensor, exchanger) -> tuple:
        """wire="values": (what Horovod allreduces, decompress_values' context)."""

    def decompress_values(self, tensor, ctx, exchanger): ...


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
    the step before), and for each of its tokens whether it said Average."""
    averaged: bool = False
    said_average: list = dataclasses.field(default_factory=list)

    def all_average(self) -> bool:
        """Every token said Average (and one came): the next step's batch of this name averages."""
        return bool(self.said_average) and all(self.said_average)


@dataclasses.dataclass
class _Batch:
    name: str
    adapter: Adapter     # the framework adapter of every tensor in the batch
    native: Optional[str] = None  # the dtype of the framework's allreduce the schedule sends it in, else codes
    flats: list = dataclasses.field(default_factory=list)   # codes batches: the gradients as float32 flats
    labels: list = dataclasses.field(default_factory=list)
    sizes: list = dataclasses.field(default_factory=list)
    nbytes: int = 0      # float32 bytes of the gradients in it
    closed: bool = False  # no more gradients join it: launched, or (native) counted
    future: object = None  # the exchange's Future (exchanger.bucket), once launched
    bucket: object = None  # its Bucket (hvd_aps._stages), once launched
    parts: Optional[list] = None  # the exchange's results per gradient, once split
    reduction: Reduction = dataclasses.field(default_factory=Reduction)  # averaged? what its tokens said


class Context:
    """decompress()'s context for a gradient compress() took on the codes path."""

    def __init__(self, generation: int, like, batch: _Batch):
        # like: the gradient (its dtype and shape come back); batch: the one it joined
        self.generation, self.like, self.batch = generation, like, batch

    @property
    def adapter(self) -> Adapter:
        return self.batch.adapter


class Ticket(Context):
    """A gradient that went into a batch of codes."""

    def __init__(self, generation: int, like, batch: _Batch, index: int):
        super().__init__(generation, like, batch)
        self.index = index


class Passed(Context):
    """A gradient the framework's own allreduce carried (policy="auto")."""


class Batches:
    """The open batch and the step's naming, for one exchanger. compress() runs on the thread
    backward runs on, decompress() on the thread that steps: a lock keeps them apart."""

    def __init__(self, exchanger):
        self._ex, self._lock = exchanger, threading.Lock()
        self._open, self._count, self._outstanding, self._generation, self._launched = None, 0, 0, 0, []
        # the last step's one gradient, where its step was that one gradient alone (see _end_step)
        self._lone = None
        self._averaged = set()  # names of the batches whose every token said Average last step

    def add(self, adapter: Adapter, tensor) -> tuple:
        """-> (what Horovod allreduces, Context) for compress()."""
        config = self._ex.config
        with self._lock, self._aborting():
            if self._open is not None and self._open.adapter is not adapter:
                self._close(self._open)
            if self._open is None:
                if self._count == 0 and self._lone not in (None, adapter.label(tensor)):
                    _warn_one_by_one()
                check_fallback(config, adapter, tensor)
                name = f"hvd_aps.{self._count}"
                self._open = _Batch(name, adapter, self._ex.state.schedule.native_dtype(),
                                    reduction=Reduction(averaged=name in self._averaged))
                self._count += 1
            batch = self._open
            batch.nbytes += 4 * adapter.numel(tensor)
            batch.labels.append(adapter.label(tensor))
            batch.sizes.append(adapter.numel(tensor))
            self._outstanding += 1
            if batch.native:
                context = Passed(self._generation, tensor, batch)
                wire = adapter.native_wire(tensor, batch.native)
            else:
                context = Ticket(self._generation, tensor, batch, len(batch.flats))
                batch.flats.append(adapter.flatten(tensor))
                wire = adapter.token(tensor)
            if batch.nbytes >= config.bucket_bytes:
                self._close(batch)
        return wire, context

    def result(self, reduced, context: Context):
        """decompress(): the exchanged gradient, reduced as Horovod's op would have left it."""
        with self._lock:
            if context.generation != self._generation:
                raise RuntimeError("this gradient's step was abandoned after an error in an earlier exchange: "
                                   "start the step again")
            if self._open is not None:  # the step's gradients are all handed over once one comes back:
                with self._aborting():  # its last batch goes now, beside the others, not when reached
                    self._close(self._open)
        try:
            if isinstance(context, Passed):
                out = context.adapter.native_result(reduced, context.like)
            else:
                total = self._parts(context.batch)[context.index]
                out = context.adapter.finish(total, reduced, context.like, context.batch.reduction)
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:  # the step is over
                out = self._end_step(context, out)
        return out

    def _parts(self, batch: _Batch) -> list:
        """The batch's results per gradient: its flat result split once (every thread that asks
        splits alike, so a race only repeats the split)."""
        if batch.parts is None:
            batch.parts = batch.bucket.split(self._ex.result(batch.future))
        return batch.parts

    def _end_step(self, context: Context, out):
        """End the step (after every exchange of it, in a graph too) and restart the naming."""
        results = [self._ex.result(batch.future) for batch in self._launched]
        self._averaged = {batch.name for batch in self._launched if batch.reduction.all_average()}
        # a step of one gradient, then one of another: Horovod hands them over one at a time
        alone = len(self._launched) == 1 and len(self._launched[0].sizes) == 1
        self._lone = self._launched[0].labels[0] if alone else None
        self._open, self._count, self._launched = None, 0, []
        return context.adapter.at_step_end(out, self._ex.end_step, results)

    def abort(self) -> None:
        """Forget the step in flight: its exchanges waited for (none may write after this), its
        state rolled back, its contexts void, the naming restarted."""
        with self._lock:
            self._forget()
        self._ex.abort_step()

    def _forget(self) -> None:
        self._open, self._count, self._outstanding, self._launched, self._lone = None, 0, 0, [], None
        self._averaged = set()  # the next step's exchanges divide nothing until tokens say Average again
        self._generation += 1

    @contextlib.contextmanager
    def _aborting(self):
        """A launch that raises (the lock held) gives the step up as abort() does."""
        try:
            yield
        except BaseException:
            self._forget()
            self._ex.abort_step()
            raise

    def _close(self, batch: _Batch) -> None:
        """No more gradients join `batch`: launch its exchange, or count the framework's allreduce
        that carries a passed-through batch as every native exchange is counted."""
        adapter = batch.adapter
        if batch.native:
            self._ex.count_native([f"{batch.name}[{i}]" for i in range(len(batch.sizes))],
                                  zip(batch.labels, batch.sizes), batch.native,
                                  exchange.ring_bytes(NATIVE_BYTES[batch.native] * sum(batch.sizes), adapter.world()))
        else:
            batch.bucket = Bucket.whole(batch.name, _keys(batch.name, len(batch.sizes)), batch.labels, batch.sizes)
            batch.future = self._ex.bucket(adapter.levels(self._ex.config.hierarchical), batch.bucket,
                                           adapter.join(batch.flats), adapter.threaded,
                                           average=batch.reduction.averaged)
            batch.flats = []  # joined: the copies of the gradients can go
            self._launched.append(batch)
        batch.closed = True
        if self._open is batch:
            self._open = None


@functools.lru_cache(maxsize=None)
def _warn_one_by_one() -> None:
    """Once per process: Horovod hands the gradients over one at a time, each exchanged alone."""
    warnings.warn("hvd_aps: Horovod hands APSCompressor one gradient at a time (each one compressed, reduced and "
                  "decompressed before the next is compressed), so every gradient is exchanged on its own and pays "
                  "an exchange's fixed cost (its collectives) alone: let Horovod compress them all first, with "
                  "num_groups=1 in TensorFlow's hvd.DistributedGradientTape / hvd.DistributedOptimizer, or "
                  "hvd.grouped_allreduce for a list of tensors", RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def _keys(name: str, count: int) -> tuple:
    """A batch's gradients' keys (made once per batch name and size)."""
    return tuple(f"{name}[{i}]" for i in range(count))


def check_fallback(config, adapter: Adapter, tensor) -> None:
    """Refuse a fallback Horovod's allreduce cannot carry at the first exchange, not after the
    trials, when policy="auto" first sends a step that way."""
    if config.policy == Policy.AUTO and config.fallback == Fallback.BFLOAT16 and not adapter.carries_bfloat16(tensor):
        raise ValueError("APSCompressor(policy='auto', fallback='bfloat16'): Horovod's own allreduce does not "
                         "carry bfloat16 here (horovod.torch only for CUDA tensors on NCCL, horovod.tensorflow "
                         "never): use fallback='float16' or 'float32', or bfloat16 with the DDP hook or FSDP2")


def pass_through(adapter: Adapter, tensor, exchanger) -> tuple:
    """A tensor too small for codes: the framework's plain allreduce carries it, in float32 as
    the codes' tokens are (Horovod's grouped allreduce takes one dtype, its Gloo no bfloat16),
    and decompress() gives it back in its dtype -> (wire, Cast context)."""
    exchanger.pass_through(adapter.label(tensor), adapter.numel(tensor))
    return adapter.native_wire(tensor, Fallback.FLOAT32), Cast(tensor)


class Cast:
    """decompress()'s context for a gradient too small for codes that went through the
    framework's allreduce in float32: `like` holds the dtype it comes back in."""

    def __init__(self, like):
        self.like = like


def token_values(rank: int) -> np.ndarray:
    """What compress() hands Horovod to reduce in place of the gradient."""
    return np.array([1.0, rank], np.float32)


def apply_op(total, token, world: int, reduction: Optional[Reduction] = None):
    """The exchanged sum (NumPy/CuPy float32, changed in place) as Horovod's reduction would have
    left it, from the reduced token: average (divided by N in float32, as every codes path
    divides), sum, or sum times the factor Horovod applied. With `reduction`, what the token says
    is recorded there, and sums its exchange already averaged come back as they are."""
    scale, ranks = float(token[0]), float(token[1])
    if abs(ranks - scale * (world - 1) / 2) > TOKEN_TOLERANCE * max(1.0, abs(scale) * world * world):
        raise ValueError(NOT_A_SUM)
    average = abs(scale - 1.0) <= TOKEN_TOLERANCE
    if reduction is not None:
        reduction.said_average.append(average)
        if reduction.averaged:
            if not average:
                raise RuntimeError("APSCompressor averaged these sums as the same gradients' allreduce did in the "
                                   "step before, and this allreduce does not average (op Sum or other pre/postscale "
                                   "factors): this step is abandoned on every rank and the next one runs as this "
                                   "op asks. Use one APSCompressor for each reduction.")
            return total
    if average:
        total /= np.float32(world)
    elif abs(scale - world) > TOKEN_TOLERANCE * world:
        total *= np.float32(scale / world)
    return total
