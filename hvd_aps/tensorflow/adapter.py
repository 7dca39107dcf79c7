"""horovod.tensorflow adapter for APSCompressor: Horovod's graph collectives for the exchange
driver, with the host stages in tf.numpy_function, so the same code runs eagerly and inside
tf.function (TF traces compress/decompress once: nothing per step lives in Python attributes of
the trace). No APS math here; hvd_aps.compressor holds it."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import codec, exchange, tokens


class HorovodCollectives(exchange.Collectives):
    """horovod.tensorflow collectives on tf.Tensors; stages run in tf.numpy_function."""

    def __init__(self, process_set=hvd.global_process_set):
        self.process_set = process_set
        self.world, self.rank = process_set.size(), process_set.rank()

    def stage(self, fn, inputs, dtypes):
        out = tf.numpy_function(fn, inputs, [tf.as_dtype(d) for d in dtypes], stateful=True)
        # a one-element Tout list comes back as a bare tensor: keep the driver's tuple contract
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def max_allreduce(self, vector, name):
        return hvd.allreduce(vector, op=hvd.Max, name=name, process_set=self.process_set)

    def alltoall(self, send, splits, name):
        received, _ = hvd.alltoall(send, splits=splits, name=name, process_set=self.process_set)
        return received

    def allgather(self, message, name):
        return hvd.allgather(message, name=name, process_set=self.process_set)


def is_dense_float(tensor):
    """IndexedSlices never get here dense: Horovod allgathers them uncompressed (or densifies them
    first with sparse_as_dense=True, and then they are compressed like any gradient)."""
    return isinstance(tensor, (tf.Tensor, tf.Variable)) and tensor.dtype.is_floating


def numel(tensor):
    count = tensor.shape.num_elements()
    if count is None:
        raise ValueError(f"APSCompressor needs gradients of known shape, got {tensor.shape} for {label(tensor)}")
    return count


def label(tensor):
    try:
        return tensor.name  # graph mode: the gradient's op name, stable across steps
    except (AttributeError, ValueError):
        return f"{tensor.dtype.name}{tensor.shape.as_list()}"


def flatten(tensor):
    return tf.reshape(tf.cast(tensor, tf.float32), [-1])


def world():
    return hvd.size()


def rank():
    return hvd.rank()


def token(tensor):
    return tf.constant(tokens.token_values(hvd.rank()))


def launch(stages, flats, name, labels):
    """The batch's exchange as graph ops (run now when eager): the sums, one per flat."""
    return exchange.run(stages, flats, HorovodCollectives(), name, labels)


def finish(handle, index, token_out, like):
    size = hvd.size()
    # a copy: numpy_function's inputs may share TF's (read-only) memory
    reduced = tf.numpy_function(lambda total, t: tokens.apply_op(total.copy(), t, size), [handle[index], token_out],
                                tf.float32, stateful=False)
    return tf.cast(tf.reshape(reduced, tf.shape(like)), like.dtype)


# wire="values" ------------------------------------------------------------------------------------
def compress_values(tensor, comp):
    x = tf.cast(tensor, tf.float32)
    local = tf.numpy_function(lambda a: comp.metadata([codec.amax(a)], [a.size]), [x], tf.float64, stateful=True)
    local.set_shape([5])
    agreed = hvd.allreduce(local, op=hvd.Max)
    size, rank_now, name = hvd.size(), hvd.rank(), label(tensor)

    def to_wire(a, g):
        amax = float(comp.agreed_amaxes(g, [a.size], [name])[0])
        wire, shift = comp.to_wire(a, amax, size, rank_now, name)
        return wire.reshape(a.shape), np.int32(shift)

    wire, shift = tf.numpy_function(to_wire, [x, agreed], [tf.as_dtype(comp.carrier), tf.int32], stateful=True)
    wire.set_shape(tensor.shape)
    return wire, (shift, tensor.dtype)


def decompress_values(tensor, ctx, comp):
    shift, dtype = ctx
    out = tf.numpy_function(lambda w, s: comp.from_wire(w, s).reshape(w.shape), [tensor, shift], tf.float32)
    out.set_shape(tensor.shape)
    return tf.cast(out, dtype)
