"""Codes through Horovod's own allreduce: batches of gradients, and the token Horovod reduces.

Horovod calls compress(t) on every gradient, allreduces what it returns and hands the result to
decompress(): torch's optimizer ends with `p.grad.set_(decompress(output, ctx))`, TF's allreduce
is `decompress(_allreduce(compress(t)), ctx)`, and grouped allreduces compress every tensor first.
So compress() adds the gradient to the open *batch* and returns a one-element token of 1.0. A
batch's codes exchange (hvd_aps.exchange) starts once it holds bucket_bytes of gradients (torch:
on the compressor's threads, while backward goes on) or at the first decompress() that needs it.

Horovod reduces the token with the op and the pre/postscale factors it applies to a gradient
(`gradient_predivide_factor`, Average's 1/N), so its value tells decompress() what to do with the
exchanged sum. The token is [1, rank]: a scaled sum gives [c N, c N (N-1) / 2], and c = 1/N means
average, c = 1 sum, anything else that factor; a reduction that is no scaled sum (Adasum, Min,
Max, Product) breaks the ratio and is refused with an error instead of returning wrong numbers.

A step is every batch handed out until each of its gradients came back through decompress():
then the step commits (residuals, step counts, the schedule's timings: hvd_aps._state) and the
next step names its batches hvd_aps.0, hvd_aps.1, ... again, so names repeat from step to step
(Horovod's response cache, reused buffers) and match across ranks that hand compress() the same
tensors in the same order (the metadata allreduce catches ranks that do not). A step whose
exchange raises is abandoned: nothing it did is kept, its other gradients' decompress() raise
too, and the next compress() starts a fresh step with the same names.
With policy="auto", a batch whose schedule settled on the framework's own allreduce is not
batched at all: its gradients go back to Horovod as they are (or cast to the fallback dtype),
counted in the stats and bytes as every native exchange is (hvd_aps.exchange.count_native).
"""
import dataclasses
import threading

import numpy as np

from . import exchange

# The token's reduced value is 1 or N up to a few float32 roundings of the scale factors.
_TOKEN_TOLERANCE = 1e-4


@dataclasses.dataclass
class _Batch:
    name: str
    adapter: object      # the framework adapter module of every tensor in the batch
    native: bool = False  # the schedule settled on the framework's allreduce: tensors pass through
    flats: list = dataclasses.field(default_factory=list)   # codes batches: the gradients as float32 flats
    labels: list = dataclasses.field(default_factory=list)
    sizes: list = dataclasses.field(default_factory=list)
    nbytes: int = 0      # float32 bytes of the gradients in it
    closed: bool = False  # no more gradients join it: launched, or (native) counted
    handle: object = None  # what adapter.launch returned, once launched


class Context:
    """decompress()'s context for a gradient compress() took on the codes path."""

    def __init__(self, generation: int, like, batch: _Batch):
        # like: the gradient (its dtype and shape come back); batch: the one it joined
        self.generation, self.like, self.batch = generation, like, batch

    @property
    def adapter(self):
        return self.batch.adapter


class Ticket(Context):
    """A gradient that went into a batch of codes."""

    def __init__(self, generation: int, like, batch: _Batch, index: int):
        super().__init__(generation, like, batch)
        self.index = index


class Passed(Context):
    """A gradient the framework's own allreduce carried (policy="auto")."""


class Batches:
    """The open batch and the step's naming, for one compressor. compress() runs on the thread
    backward runs on, decompress() on the thread that steps: a lock keeps them apart."""

    def __init__(self, compressor):
        self._comp, self._lock = compressor, threading.Lock()
        self._open, self._count, self._outstanding, self._generation, self._launched = None, 0, 0, 0, []

    def add(self, adapter, tensor) -> tuple:
        """-> (what Horovod allreduces, Context) for compress()."""
        with self._lock:
            if self._open is not None and self._open.adapter is not adapter:
                self._close(self._open)
            if self._open is None:
                name = f"hvd_aps.{self._count}"
                self._open = _Batch(name, adapter, self._comp.state.schedule.native(name))
                self._count += 1
            batch = self._open
            batch.nbytes += 4 * adapter.numel(tensor)
            batch.labels.append(adapter.label(tensor))
            batch.sizes.append(adapter.numel(tensor))
            self._outstanding += 1
            if batch.native:
                context = Passed(self._generation, tensor, batch)
                wire = adapter.native_wire(tensor, self._comp.config.fallback)
            else:
                context = Ticket(self._generation, tensor, batch, len(batch.flats))
                batch.flats.append(adapter.flatten(tensor))
                wire = adapter.token(tensor)
            if batch.nbytes >= self._comp.config.bucket_bytes:
                self._close(batch)
        return wire, context

    def result(self, reduced, context: Context):
        """decompress(): the exchanged gradient, reduced as Horovod's op would have left it."""
        with self._lock:
            if context.generation != self._generation:
                raise RuntimeError("this gradient's step was abandoned after an error in an earlier exchange: "
                                   "start the step again")
            if not context.batch.closed:
                self._close(context.batch)
        try:
            if isinstance(context, Passed):
                out = context.adapter.native_result(reduced, context.like)
            else:
                out = context.adapter.finish(context.batch.handle, context.index, reduced, context.like)
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:  # the step is over
                out = self._end_step(context, out)
        return out

    def _end_step(self, context: Context, out):
        """Commit the step (after every exchange of it, in a graph too) and restart the naming."""
        handles = [b.handle for b in self._launched]
        self._open, self._count, self._launched = None, 0, []
        return context.adapter.after(out, self._comp.state.commit, handles)

    def abort(self) -> None:
        """Forget the step in flight: its exchanges waited for (none may write after this), its
        state rolled back, its contexts void, the naming restarted."""
        with self._lock:
            launched = self._launched
            self._open, self._count, self._outstanding, self._launched = None, 0, 0, []
            self._generation += 1
        for batch in launched:
            batch.adapter.settle(batch.handle)
        self._comp.state.rollback()

    def _close(self, batch: _Batch) -> None:
        """No more gradients join `batch`: launch its exchange, or count the framework's allreduce
        that carries a passed-through batch as every native exchange is counted."""
        if batch.native:
            dtype = np.dtype(str(self._comp.config.fallback))
            exchange.count_native(self._comp.recorder, self._comp.state,
                                  [f"{batch.name}[{i}]" for i in range(len(batch.sizes))],
                                  zip(batch.labels, batch.sizes), dtype.name,
                                  exchange.ring_bytes(dtype.itemsize * sum(batch.sizes), batch.adapter.world()))
        else:
            batch.handle = batch.adapter.launch(self._comp, batch.name, batch.flats, batch.labels)
            self._launched.append(batch)
        batch.closed = True
        if self._open is batch:
            self._open = None


def token_values(rank: int) -> np.ndarray:
    """What compress() hands Horovod to reduce in place of the gradient."""
    return np.array([1.0, rank], np.float32)


def apply_op(total, token, world: int):
    """The exchanged sum (NumPy/CuPy float32, changed in place) as Horovod's reduction would have
    left it, from the reduced token: average (divided by N in float32, as every codes path
    divides), sum, or sum times the factor Horovod applied."""
    scale, ranks = (float(v) for v in np.asarray(token, np.float64).reshape(-1)[:2])
    if abs(ranks - scale * (world - 1) / 2) > _TOKEN_TOLERANCE * max(1.0, abs(scale) * world * world):
        raise ValueError("APSCompressor's codes need an allreduce that sums (op Average or Sum, with any "
                         "pre/postscale); this reduction is not one (Adasum, Min, Max or Product?): use "
                         "APSCompressor(..., wire='values') for it")
    if abs(scale - 1.0) <= _TOKEN_TOLERANCE:
        total /= np.float32(world)
    elif abs(scale - world) > _TOKEN_TOLERANCE * world:
        total *= np.float32(scale / world)
    return total
