"""horovod.tensorflow adapter for APSCompressor: Horovod's graph collectives for the exchange
driver (one object per process set), with the host stages in tf.numpy_function, so the same code
runs eagerly and inside tf.function (TF traces compress/decompress once: nothing per step lives
in Python attributes of the trace). No APS math here."""
import functools
import warnings

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import _metadata, _tokens, _values, codec, exchange
from .._horovod import HorovodLevels
from .._stages import Bucket
from ..config import AUTO, GRAPH_CHUNK_BYTES


class HorovodCollectives(exchange.Collectives):
    """horovod.tensorflow collectives on tf.Tensors within one process set; stages run in
    tf.numpy_function (at once when eager, as graph ops inside tf.function)."""

    equal_allgather = False  # Horovod gathers messages of any sizes

    def __init__(self, process_set=hvd.global_process_set):
        self.process_set = process_set
        self.world, self.rank = process_set.size(), process_set.rank()

    @property
    def eager(self):
        return tf.executing_eagerly()

    def stage(self, fn, inputs, dtypes):
        out = tf.numpy_function(fn, inputs, [tf.as_dtype(d) for d in dtypes], stateful=True)
        # a one-element Tout list comes back as a bare tensor: keep the driver's tuple contract
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def max_allreduce(self, vector, name):
        return hvd.allreduce(vector, op=hvd.Max, name=name, process_set=self.process_set)

    def allreduce(self, values, name):
        return hvd.allreduce(values, op=hvd.Sum, name=name, process_set=self.process_set)

    def alltoall(self, send, splits, name):
        received, _ = hvd.alltoall(send, splits=splits, name=name, process_set=self.process_set)
        return received

    def allgather(self, message, name):
        return hvd.allgather(message, name=name, process_set=self.process_set)


_LEVELS = HorovodLevels(hvd, HorovodCollectives)


def levels(hierarchical) -> exchange.Levels:
    """The exchange's groups (hvd_aps._horovod), found eagerly even while a graph is traced."""
    with tf.init_scope():
        return _LEVELS.get(hierarchical)


def forget_groups() -> None:
    _LEVELS.forget()


def run(compressor, name, flats, labels, keys=None, average=False):
    """A bucket's exchange as graph ops (run now when eager): the sums (averages), one per flat."""
    lv = levels(compressor.config.hierarchical)
    stages = compressor.stages(lv.cross.world, lv.cross.rank, hvd.rank())
    sizes = [numel(f) for f in flats]
    bucket = Bucket.whole(name, keys or [f"{name}[{i}]" for i in range(len(flats))], labels, sizes)
    config = compressor.config
    if not tf.executing_eagerly() and config.policy == "auto":
        _warn_graph_policy()
    return exchange.run(stages, bucket, flats, lv, average=average,
                        graph_chunk_bytes=GRAPH_CHUNK_BYTES if config.chunk_bytes == AUTO else config.chunk_bytes)


@functools.lru_cache(maxsize=None)
def _warn_graph_policy():
    warnings.warn("hvd_aps: inside tf.function the exchange is fixed when traced, so policy='auto' cannot switch "
                  "buckets to the framework's allreduce there: codes are sent (run eagerly to let it choose)",
                  RuntimeWarning, stacklevel=4)


# The codes path through Horovod's own allreduce ------------------------------------------------------
def is_dense_float(tensor):
    """IndexedSlices never get here dense: Horovod allgathers them uncompressed (or densifies them
    first with sparse_as_dense=True, and then they are compressed like any gradient)."""
    return isinstance(tensor, (tf.Tensor, tf.Variable)) and tensor.dtype.is_floating


def is_empty(tensor):
    return tensor.shape.num_elements() == 0  # None (a shape known when run) is not empty


def world():
    """The ranks Horovod's allreduce spans: a passed-through batch's bytes."""
    return hvd.size()


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


def token(tensor):
    return tf.constant(_tokens.token_values(hvd.rank()))


def launch(compressor, name, flats, labels):
    return run(compressor, name, flats, labels)


def finish(handle, index, token_out, like):
    size = hvd.size()
    # a copy: numpy_function's inputs may share TF's (read-only) memory
    reduced = tf.numpy_function(lambda total, t: _tokens.apply_op(total.copy(), t, size), [handle[index], token_out],
                                tf.float32, stateful=False)
    return tf.cast(tf.reshape(reduced, tf.shape(like)), like.dtype)


def committed(commit, results):
    """Commit now when eager (-> None), else -> a graph op that commits once `results` exist."""
    if tf.executing_eagerly():
        commit()
        return None

    def run(*_):
        commit()
        return np.zeros(0, np.uint8)

    return tf.numpy_function(run, list(results), tf.uint8, stateful=True)


def after(out, commit, handles):
    """The step's last result, returned once the step has committed (every exchange of it done)."""
    done = committed(commit, [t for handle in handles for t in handle] or [out])
    if done is None:
        return out
    with tf.control_dependencies([done]):
        return tf.identity(out)


def settle(handle):
    """Nothing to wait for: eager exchanges have ended, graph ones end with their step."""


def reducible(tensor):
    """Whether Horovod's own allreduce takes this dtype: not bfloat16 (a small bfloat16 gradient
    goes in float32)."""
    return tensor.dtype != tf.bfloat16


def native_wire(tensor, fallback):
    return tf.cast(tensor, tf.as_dtype(str(fallback)))


def native_result(reduced, like):
    return tf.cast(reduced, like.dtype)


# wire="values" ------------------------------------------------------------------------------------
def compress_values(tensor, comp):
    x = tf.cast(tensor, tf.float32)
    local = tf.numpy_function(lambda a: _metadata.vector(comp.config, [codec.amax(a)], [a.size]), [x], tf.float64,
                              stateful=True)
    local.set_shape([3 + _metadata.TIMING + 2])
    agreed = hvd.allreduce(local, op=hvd.Max)
    size, rank_now, name = hvd.size(), hvd.rank(), label(tensor)

    def to_wire(a, g):
        amax = float(_metadata.read(comp.config, g, [a.size], [name])[0][0])
        seed = comp.state.values_seed(rank_now, name)
        wire, shift = _values.to_wire(comp.config, comp.recorder, a, amax, size, seed, name)
        return wire.reshape(a.shape), np.int32(shift)

    wire, shift = tf.numpy_function(to_wire, [x, agreed], [tf.as_dtype(_values.carrier(comp.fmt)), tf.int32],
                                    stateful=True)
    wire.set_shape(tensor.shape)
    return wire, (shift, tensor.dtype, name)


def decompress_values(tensor, ctx, comp):
    shift, dtype, name = ctx

    def from_wire(w, s):
        comp.state.values_done(name)
        return _values.from_wire(w, s).reshape(w.shape)

    out = tf.numpy_function(from_wire, [tensor, shift], tf.float32, stateful=True)
    out.set_shape(tensor.shape)
    return tf.cast(out, dtype)
