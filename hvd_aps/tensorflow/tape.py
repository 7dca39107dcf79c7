"""Codes on the wire for horovod.tensorflow: allreduce_codes() and DistributedGradientTape.

The stages of hvd_aps.wire run in tf.numpy_function between Horovod's own graph collectives
(Max-allreduce, alltoall, allgather), so the exchange works eagerly and inside tf.function; buckets
have no data dependence on each other, so TensorFlow overlaps them. A tensor whose agreed max is
not finite comes back filled with NaN on every rank (the graph's shape is fixed, so it cannot take
a plain allreduce on the side as the torch optimizer does).
"""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import wire
from ..compressor import APSCompressor


def _exchange_bucket(flats, ex, average, name):
    state = {}

    def begin(agreed, *arrays):
        send, splits, state["s"] = ex.begin(list(arrays), agreed)
        return send, np.array(splits, np.int32)

    def finish(gathered, *arrays):
        s = state.pop("s")
        results = dict(zip(s.included, ex.finish(gathered, s, average)))
        return [results.get(i, np.full(a.shape, np.nan, np.float32)) for i, a in enumerate(arrays)]

    meta = tf.numpy_function(lambda *a: ex.metadata(list(a)), flats, tf.float32, stateful=True)
    agreed = hvd.allreduce(meta, op=hvd.Max, name=f"{name}.meta")
    send, splits = tf.numpy_function(begin, [agreed, *flats], [tf.uint8, tf.int32], stateful=True)
    received, _ = hvd.alltoall(send, splits=splits, name=f"{name}.codes")
    message = tf.numpy_function(lambda r: ex.reduce_shard(r, state["s"]), [received], tf.uint8, stateful=True)
    gathered = hvd.allgather(message, name=f"{name}.shards")
    return tf.numpy_function(finish, [gathered, *flats], [tf.float32] * len(flats), stateful=True)


def allreduce_codes(tensors, compression, op=hvd.Average, bucket_bytes=16 << 20, min_elements=4096,
                    name="hvd_aps"):
    """Average (op=hvd.Average) or sum (hvd.Sum) dense float tensors across ranks, sending APS codes
    of compression.fmt; tensors under min_elements take a plain Horovod allreduce."""
    if not isinstance(compression, APSCompressor):
        raise TypeError(f"allreduce_codes sends APS codes: pass an hvd_aps.APSCompressor, got {compression!r}")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if hvd.size() == 1:
        return tensors
    sizes = [t.shape.num_elements() for t in tensors]
    if None in sizes:
        raise ValueError("allreduce_codes needs tensors of known shape")
    buckets, small = wire.buckets(sizes, bucket_bytes, min_elements)
    ex = wire.CodesExchange(compression, hvd.size(), hvd.rank())
    out = [None] * len(tensors)
    for i in small:
        out[i] = hvd.allreduce(tensors[i], op=op, name=f"{name}.small{i}")
    for b, bucket in enumerate(buckets):
        flats = [tf.reshape(tf.cast(tensors[i], tf.float32), [-1]) for i in bucket]
        results = _exchange_bucket(flats, ex, op == hvd.Average, f"{name}.bucket{b}")
        for i, r in zip(bucket, results):
            out[i] = tf.cast(tf.reshape(r, tensors[i].shape), tensors[i].dtype)
    return out


class DistributedGradientTape:
    """Wraps a tf.GradientTape like horovod.tensorflow.DistributedGradientTape; gradient() returns
    gradients averaged across ranks through allreduce_codes. IndexedSlices are densified."""

    def __init__(self, tape, compression, op=hvd.Average, bucket_bytes=16 << 20, min_elements=4096):
        self._tape, self._compression, self._op = tape, compression, op
        self._bucket_bytes, self._min_elements = bucket_bytes, min_elements

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients)
        flat = tf.nest.flatten(grads)
        present = [i for i, g in enumerate(flat) if g is not None]
        reduced = allreduce_codes([tf.convert_to_tensor(flat[i]) for i in present], self._compression, self._op,
                                  self._bucket_bytes, self._min_elements)
        for i, r in zip(present, reduced):
            flat[i] = r
        return tf.nest.pack_sequence_as(grads, flat)
