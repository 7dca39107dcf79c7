"""horovod.tensorflow adapter for APSCompressor. TensorFlow traces compress/decompress into a
graph once, so the per-step work runs inside tf.numpy_function and nothing per step is kept in
Python attributes of the trace. No APS math here; hvd_aps.compressor holds it."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import codec


def is_dense_float(tensor):
    """IndexedSlices never get here dense: Horovod allgathers them uncompressed (or densifies them
    first with sparse_as_dense=True, and then they are compressed like any gradient)."""
    return isinstance(tensor, (tf.Tensor, tf.Variable)) and tensor.dtype.is_floating


def _label(tensor):
    try:
        return tensor.name  # graph mode: the gradient's op name, stable across steps
    except (AttributeError, ValueError):
        return f"{tensor.dtype.name}{tensor.shape.as_list()}"


def compress(tensor, comp):
    x = tf.cast(tensor, tf.float32)
    local = tf.numpy_function(lambda a: comp.metadata(codec.amax(a)), [x], tf.float32, stateful=True)
    local.set_shape([3])
    agreed = hvd.allreduce(local, op=hvd.Max)
    size, rank, label = hvd.size(), hvd.rank(), _label(tensor)

    def to_wire(a, g):
        wire, shift = comp.to_wire(a, comp.check_agreed(g), size, rank, label)
        return wire.reshape(a.shape), np.int32(shift)

    wire, shift = tf.numpy_function(to_wire, [x, agreed], [tf.as_dtype(comp.carrier), tf.int32], stateful=True)
    wire.set_shape(tensor.shape)
    return wire, (shift, tensor.dtype)


def decompress(tensor, ctx, comp):
    shift, dtype = ctx
    out = tf.numpy_function(lambda w, s: comp.from_wire(w, s).reshape(w.shape), [tensor, shift], tf.float32)
    out.set_shape(tensor.shape)
    return tf.cast(out, dtype)
