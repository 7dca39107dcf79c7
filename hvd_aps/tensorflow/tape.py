"""Codes on the wire for horovod.tensorflow without Horovod's optimizer: allreduce_codes() and
DistributedGradientTape, through the one exchange driver (hvd_aps.exchange) with Horovod's graph
collectives, eagerly and inside tf.function; buckets have no data dependence on each other, so
TensorFlow overlaps them. A tensor that held NaN/Inf on any rank comes back all NaN everywhere.
"""
import horovod.tensorflow as hvd
import tensorflow as tf

from .. import _layout, _tokens
from .._stages import Bucket
from ..compressor import APSCompressor
from . import adapter
from .adapter import ended, flatten, label, levels, reducible


@tf.autograph.experimental.do_not_convert  # plain Python that builds its graph ops itself
def allreduce_codes(tensors, compression, op=hvd.Average, name="hvd_aps"):
    """Average (op=hvd.Average) or sum (hvd.Sum) dense float tensors across ranks, sending APS codes
    of compression.fmt; tensors under compression.config.min_elements take a plain Horovod
    allreduce, the rest travel in buckets of compression.config.bucket_bytes. One call is one
    step of the compressor's state: it commits once every bucket is done (eagerly: a call that
    raises leaves the state as it was)."""
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
    cfg, exchanger = compression.config, compression.exchanger
    buckets, small = _layout.buckets(sizes, cfg.bucket_bytes, cfg.min_elements)
    if buckets:
        _tokens.check_fallback(cfg, adapter, tensors[buckets[0][0]])
    out, exchanged = [None] * len(tensors), []
    for i in small:
        out[i] = _plain_allreduce(tensors[i], op, f"{name}.small{i}")
        exchanger.pass_through(label(tensors[i]), sizes[i])
    lv = levels(cfg.hierarchical, timeout=cfg.timeout)
    for b, members in enumerate(buckets):
        keys = [f"{name}.bucket{b}[{j}]" for j in range(len(members))]
        bucket = Bucket.whole(f"{name}.bucket{b}", keys, [label(tensors[i]) for i in members],
                              [sizes[i] for i in members])
        # a bucket that raises gives the step up (Exchanger.exchange): the state as before the call
        result = exchanger.bucket(lv, bucket, tf.concat([flatten(tensors[i]) for i in members], 0),
                                  threaded=False, average=op == hvd.Average).result()
        exchanged.append(result)
        for i, result in zip(members, bucket.split(result)):
            out[i] = tf.cast(tf.reshape(result, tf.shape(tensors[i])), tensors[i].dtype)
    done = ended(exchanger.end_step, exchanged) if buckets else None
    if done is None:
        return out
    with tf.control_dependencies([done]):  # the step ends once every bucket is done; the results wait for it
        return [tf.identity(t) for t in out]


def _plain_allreduce(tensor, op, name):
    """Horovod's own allreduce; a dtype it refuses (bfloat16) in float32."""
    if reducible(tensor):
        return hvd.allreduce(tensor, op=op, name=name)
    return tf.cast(hvd.allreduce(tf.cast(tensor, tf.float32), op=op, name=name), tensor.dtype)


class DistributedGradientTape:
    """Wraps a tf.GradientTape like horovod.tensorflow.DistributedGradientTape; gradient() returns
    gradients averaged (or summed, op=hvd.Sum) across ranks through allreduce_codes.
    IndexedSlices are densified."""

    def __init__(self, tape, compression, op=hvd.Average):
        self._tape, self._compression, self._op = tape, compression, op

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients)
        flat = tf.nest.flatten(grads)
        present = [i for i, g in enumerate(flat) if g is not None]
        reduced = allreduce_codes([tf.convert_to_tensor(flat[i]) for i in present], self._compression, self._op)
        for i, r in zip(present, reduced):
            flat[i] = r
        return tf.nest.pack_sequence_as(grads, flat)

    def __getattr__(self, attr):  # watch(), stop_recording() and the rest of the tape's API
        return getattr(self._tape, attr)
