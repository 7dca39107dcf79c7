"""The one exchange driver: a bucket's codes exchange, with the collectives passed in.

Every codes path runs through `run`: APSCompressor inside Horovod's own optimizers (torch and TF),
hvd_aps.torch.DistributedOptimizer, hvd_aps.tensorflow's tape and the torch.distributed DDP hook.
What differs between them is a `Collectives` object: three collectives and a way to run a host
stage (a plain call for eager torch, tf.numpy_function inside a TF graph). The stages themselves
are hvd_aps.wire.CodesExchange's.

Steps, for one bucket of flat float32 gradients:
1. stage: each tensor's max |g| and size, the compressor's signature;   collective: Max-allreduce
2. stage: APS shifts, encode, cut one shard per rank (packed);          collective: alltoall
3. stage: decode-and-sum this rank's shard, re-encode it;               collective: allgather
4. stage: decode every rank's shard into the sums.
"""
import abc

import numpy as np


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


class Eager(Collectives):
    """Collectives for frameworks that run Python as they go: a stage is a plain call."""

    def stage(self, fn, inputs, dtypes):
        return fn(*inputs)


def run(stages, flats, coll, name, labels=None, outs=None, average=False):
    """One bucket's exchange -> the float32 sums across ranks (average=True: divided by N), one
    flat per input (NaN-filled where a rank held NaN/Inf). `stages`: a wire.CodesExchange;
    `name`: stable from step to step and equal on every rank (collective names, buffer keys);
    `outs`: eager callers may pass the arrays to write the results into."""
    state = {}

    def begin(agreed, *arrays):
        send, splits, state["s"] = stages.begin(list(arrays), agreed, name, labels)
        return send, np.asarray(splits, np.int32)

    def reduce(received):
        return (stages.reduce_shard(received, state["s"], name),)

    def finish(gathered):
        return tuple(stages.finish(gathered, state.pop("s"), outs, name, average))

    meta, = coll.stage(lambda *arrays: (stages.metadata(arrays, name),), flats, [np.float64])
    agreed = coll.max_allreduce(meta, f"{name}.meta")
    send, splits = coll.stage(begin, [agreed, *flats], [np.uint8, np.int32])
    received = coll.alltoall(send, splits, f"{name}.codes")
    message, = coll.stage(reduce, [received], [np.uint8])
    gathered = coll.allgather(message, f"{name}.shards")
    return list(coll.stage(finish, [gathered], [np.float32] * len(flats)))
