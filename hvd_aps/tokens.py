"""Codes through Horovod's own allreduce: batches of gradients, and the token Horovod reduces.

Horovod calls compress(t) on every gradient, allreduces what it returns and hands the result to
decompress(): torch's optimizer ends with `p.grad.set_(decompress(output, ctx))`, TF's allreduce
is `decompress(_allreduce(compress(t)), ctx)`, and grouped allreduces compress every tensor first.
So compress() adds the gradient to the open *batch* and returns a one-element token of 1.0. A
batch's codes exchange (hvd_aps.exchange) starts once it holds bucket_bytes of gradients (torch:
on a communication thread, while backward goes on) or at the first decompress() that needs it.

Horovod reduces the token with the op and the pre/postscale factors it applies to a gradient
(`gradient_predivide_factor`, Average's 1/N), so its value tells decompress() what to do with the
exchanged sum. The token is [1, rank]: a scaled sum gives [c N, c N (N-1) / 2], and c = 1/N means
average, c = 1 sum, anything else that factor; a reduction that is no scaled sum (Adasum, Min,
Max, Product) breaks the ratio and is refused with an error instead of returning wrong numbers.

Batches are named hvd_aps.<k>, k counting from 0 again whenever every batch handed out has been
decompressed (once per training step), so names repeat from step to step (Horovod's response
cache) and match across ranks that hand compress() the same tensors in the same order. Ranks that
do not are caught by the size check in the metadata allreduce.
"""
import dataclasses
import threading

import numpy as np

# The token's reduced value is 1 or N up to a few float32 roundings of the scale factors.
_TOKEN_TOLERANCE = 1e-4


@dataclasses.dataclass
class _Batch:
    name: str
    adapter: object      # the framework adapter module of every tensor in the batch
    flats: list = dataclasses.field(default_factory=list)
    labels: list = dataclasses.field(default_factory=list)
    nbytes: int = 0      # float32 bytes of the gradients in it
    handle: object = None  # what adapter.launch returned, once launched


@dataclasses.dataclass(frozen=True)
class Ticket:
    """decompress()'s context for a gradient that went into a batch."""
    batch: _Batch
    index: int
    like: object  # the gradient compress() was given (its dtype and shape come back)


class Batches:
    """The open batch and the step's naming, for one compressor. compress() runs on the thread
    backward runs on, decompress() on the thread that steps: a lock keeps them apart."""

    def __init__(self, compressor):
        self._comp, self._lock = compressor, threading.Lock()
        self._open, self._count, self._outstanding = None, 0, 0

    def add(self, adapter, tensor):
        """-> (token, Ticket) for compress()."""
        with self._lock:
            if self._open is not None and self._open.adapter is not adapter:
                self._launch(self._open)
            if self._open is None:
                self._open = _Batch(f"hvd_aps.{self._count}", adapter)
                self._count += 1
            batch = self._open
            ticket = Ticket(batch, len(batch.flats), tensor)
            batch.flats.append(adapter.flatten(tensor))
            batch.labels.append(adapter.label(tensor))
            batch.nbytes += 4 * adapter.numel(tensor)
            self._outstanding += 1
            if batch.nbytes >= self._comp.config.bucket_bytes:
                self._launch(batch)
        return adapter.token(tensor), ticket

    def result(self, token, ticket):
        """decompress(): the exchanged gradient, reduced as Horovod's op would have left it."""
        batch = ticket.batch
        with self._lock:
            if batch.handle is None:
                self._launch(batch)
            self._outstanding -= 1
            if self._outstanding == 0:  # the step is over: the next one names its batches alike
                self._count = 0
        return batch.adapter.finish(batch.handle, ticket.index, token, ticket.like)

    def _launch(self, batch):
        adapter = batch.adapter
        stages = self._comp.stages(adapter.world(), adapter.rank())
        batch.handle = adapter.launch(stages, batch.flats, batch.name, batch.labels)
        if self._open is batch:
            self._open = None


def token_values(rank):
    """What compress() hands Horovod to reduce in place of the gradient."""
    return np.array([1.0, rank], np.float32)


def apply_op(total, token, world):
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
