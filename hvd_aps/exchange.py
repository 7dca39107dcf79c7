"""The one exchange driver: a bucket's codes exchange, with the collectives passed in.

Every codes path runs through `run`: APSCompressor inside Horovod's own optimizers (torch and TF),
hvd_aps.torch.DistributedOptimizer, hvd_aps.tensorflow's tape and the torch.distributed DDP hook.
What differs between them is a `Collectives` object: three collectives and a way to run a host
stage (a plain call for eager torch, tf.numpy_function inside a TF graph). The stages themselves
are hvd_aps.wire.CodesExchange's.

Steps, for one bucket of flat float32 gradients:
1. stage: each tensor's max |g| and size, the compressor's signature;   collective: Max-allreduce
2. stage: APS shifts and formats agreed, the bucket cut into chunks;
then for every chunk, pipelined (chunk k is encoded while k-1's codes travel and k-2 is decoded):
3. stage: encode the chunk, cut one shard per rank (packed);             collective: alltoall
4. stage: decode-and-sum this rank's shard, re-encode it;                collective: allgather
5. stage: decode every rank's shard into the results.
Collectives that can start without waiting (Horovod's and torch.distributed's async ops) let
the codec work on one chunk while another is on the wire; blocking ones run the same schedule
one step at a time.
"""
import abc

import numpy as np

from . import _arrays


class Collectives(abc.ABC):
    """What the driver needs from a framework. Arrays in and out are the framework's own kind
    (NumPy/CuPy arrays for eager torch, tf.Tensor inside TF)."""

    world: int
    rank: int

    @abc.abstractmethod
    def stage(self, fn, inputs, dtypes):
        """Run fn(*inputs) -> a tuple of arrays of `dtypes` (NumPy dtypes), return that tuple."""

    @abc.abstractmethod
    def max_allreduce(self, vector, name):
        """Elementwise max over the ranks of a float64 vector."""

    @abc.abstractmethod
    def alltoall(self, send, splits, name):
        """uint8 bytes: splits[r] of `send` to rank r; returns what every rank sent here, in rank order."""

    @abc.abstractmethod
    def allgather(self, message, name):
        """Every rank's uint8 message, concatenated in rank order."""

    def alltoall_start(self, send, splits, name):
        """Start an alltoall -> a handle for wait(); by default it runs to the end at once."""
        return self.alltoall(send, splits, name)

    def allgather_start(self, message, name):
        return self.allgather(message, name)

    def wait(self, handle):
        """The result of a started collective."""
        return handle


class Eager(Collectives):
    """Collectives for frameworks that run Python as they go: a stage is a plain call."""

    def stage(self, fn, inputs, dtypes):
        return fn(*inputs)


class AsyncEager(Eager):
    """Eager collectives whose alltoall and allgather can start without waiting: subclasses
    give alltoall_start, allgather_start and wait; the blocking forms are a start and a wait."""

    @abc.abstractmethod
    def alltoall_start(self, send, splits, name):
        """-> a handle for wait()."""

    @abc.abstractmethod
    def allgather_start(self, message, name):
        """-> a handle for wait()."""

    @abc.abstractmethod
    def wait(self, handle):
        """The result of a started collective, as the blocking form returns it."""

    def alltoall(self, send, splits, name):
        return self.wait(self.alltoall_start(send, splits, name))

    def allgather(self, message, name):
        return self.wait(self.allgather_start(message, name))


def run(stages, flats, coll, name, labels=None, outs=None, average=False):
    """One bucket's exchange -> the float32 sums across ranks (average=True: divided by N), one
    flat per input (NaN-filled where a rank held NaN/Inf). `stages`: a wire.CodesExchange;
    `name`: stable from step to step and equal on every rank (collective names, buffer keys);
    `outs`: eager callers may pass the arrays to write the results into."""
    sizes = [int(f.shape[0]) for f in flats]
    chunks = stages.chunk_count(sizes)
    held = {}  # what one stage hands the next: plain Python, so graph stages share it too

    def agree(agreed):
        xp = _arrays.array_module(flats[0]) if flats else np  # NumPy for graph tensors: their stages see NumPy
        held["bucket"] = stages.agree(agreed, sizes, name, labels, outs, average, xp)
        return (_TOKEN,)

    def begin(c):
        def stage(token, *arrays):
            send, splits, held[c] = stages.begin(list(arrays), held["bucket"], c)
            return send, np.asarray(splits, np.int32)
        return stage

    def finish(c):
        def stage(gathered):
            stages.finish(gathered, held.pop(c))
            return (_TOKEN,)
        return stage

    meta, = coll.stage(lambda *arrays: (stages.metadata(arrays, name),), flats, [np.float64])
    agreed = coll.max_allreduce(meta, f"{name}.meta")
    token, = coll.stage(agree, [agreed], [np.uint8])
    codes, shards, finished = {}, {}, []
    for c in range(chunks + 2):
        if c < chunks:
            send, splits = coll.stage(begin(c), [token, *flats], [np.uint8, np.int32])
            codes[c] = coll.alltoall_start(send, splits, f"{name}.codes{c}")
        if 0 <= c - 1 < chunks:
            message, = coll.stage(lambda received, k=c - 1: (stages.reduce_shard(received, held[k]),),
                                  [coll.wait(codes.pop(c - 1))], [np.uint8])
            shards[c - 1] = coll.allgather_start(message, f"{name}.shards{c - 1}")
        if c - 2 >= 0:
            finished += coll.stage(finish(c - 2), [coll.wait(shards.pop(c - 2))], [np.uint8])
    return list(coll.stage(lambda *done: tuple(stages.done(held.pop("bucket"))), finished,
                           [np.float32] * len(flats)))


_TOKEN = np.zeros(0, np.uint8)  # what ordering-only stages return: graph stages run in data order
