"""horovod.tensorflow adapter for APSCompressor (hvd_aps._tokens.Adapter): Horovod's graph
collectives for the exchange driver (one object per process set), with the host stages in
tf.numpy_function, so the same code runs eagerly and inside tf.function (TF traces
compress/decompress once: nothing per step lives in Python attributes of the trace). No APS math
here."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import _horovod, _metadata, _tokens, _values, codec, exchange
from .._horovod import HorovodLevels, is_global
from ..config import DEFAULT_TIMEOUT


# frames above compress() looked at for Horovod's process set: AutoGraph's converted_call and
# its helpers lie between compress() and the converted Horovod function
TRACED_CALL_DEPTH = 12


class HorovodCollectives(exchange.Collectives):
    """horovod.tensorflow collectives on tf.Tensors within one process set; stages run in
    tf.numpy_function (at once when eager, as graph ops inside tf.function). `timeout` bounds
    nothing here: Horovod's TF ops wait inside TensorFlow's runtime, with no handle to poll."""

    equal_allgather = False  # Horovod gathers messages of any sizes

    def __init__(self, process_set=hvd.global_process_set, timeout: float = DEFAULT_TIMEOUT):
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


def levels(hierarchical, process_set=None, timeout=DEFAULT_TIMEOUT) -> exchange.Levels:
    """The exchange's groups (hvd_aps._horovod), found eagerly even while a graph is traced
    (`timeout`: HorovodCollectives)."""
    with tf.init_scope():
        return _LEVELS.get(hierarchical, process_set, timeout)


def call_site(frame):
    """The process set of a compress() call, without a key: a graph fixes its exchanges when it
    is traced, so its gradients go in batches in the order it hands them over. Traced, Horovod's
    function is AutoGraph's conversion of it, some frames up (DistributedGradientTape traces its
    allreduces even when eager): the nearest frame holding a `process_set` gives it."""
    for _ in range(TRACED_CALL_DEPTH):
        if frame is None:
            break
        process_set = frame.f_locals.get("process_set")
        if hasattr(process_set, "process_set_id"):
            return _horovod.Site(None, process_set)
        frame = frame.f_back
    return _horovod.NOWHERE




def forget_groups() -> None:
    _LEVELS.forget()


# The codes path through Horovod's own allreduce ------------------------------------------------------
threaded = False  # exchanges are graph ops (run at once when eager), which TF runs in parallel


def is_dense_float(tensor):
    """IndexedSlices never get here dense: Horovod allgathers them uncompressed (or densifies them
    first with sparse_as_dense=True, and then they are compressed like any gradient)."""
    return isinstance(tensor, (tf.Tensor, tf.Variable)) and tensor.dtype.is_floating


def is_empty(tensor):
    return tensor.shape.num_elements() == 0  # None (a shape known when run) is not empty


def world(process_set=None):
    """The ranks Horovod's allreduce spans (on `process_set`; None: every rank)."""
    return hvd.size() if is_global(process_set) else process_set.size()


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


def join(flats):
    return tf.concat(flats, 0)


def token(tensor, process_set=None):
    return tf.constant(_tokens.token_values(hvd.rank() if is_global(process_set) else process_set.rank()))


def place(tensor):
    """TensorFlow runs the exchange's ops itself, on its own streams."""
    return None


def finish(total, token_out, like, reduction, ranks):
    """_tokens.apply_op's arithmetic as graph ops (a numpy_function a gradient cost ~0.1 ms each):
    the same divisions and products in float32, the same refusal of a reduction that is no sum.
    `reduction` is not used: a graph fixes its exchanges when traced, so none is averaged."""
    size, tolerance = ranks, _tokens.TOKEN_TOLERANCE
    token = tf.cast(tf.reshape(token_out, [-1]), tf.float64)
    scale, ranks = token[0], token[1]
    one = tf.constant(1.0, tf.float64)
    summed = tf.abs(ranks - scale * (size - 1) / 2) <= tolerance * tf.maximum(one, tf.abs(scale) * size * size)
    average, scaled = tf.abs(scale - 1) <= tolerance, tf.abs(scale - size) > tolerance * size
    # x / 1 and x * 1 are x, bit for bit: one division (an average's) and one product (a factor's)
    divisor = tf.where(average, np.float32(size), np.float32(1))
    factor = tf.where(scaled & ~average, tf.cast(scale / size, tf.float32), np.float32(1))
    with tf.control_dependencies([tf.debugging.Assert(summed, [_tokens.NOT_A_SUM])]):
        reduced = total / divisor * factor
    return tf.cast(tf.reshape(reduced, tf.shape(like)), like.dtype)


def read_tokens(tokens):
    """The adapter contract's one read of a step's tokens (eager tensors); finish() here leaves
    none unread: a graph fixes its exchanges when traced, so no batch averaged before."""
    return [tf.reshape(token, [-1]).numpy().tolist() for token in tokens]


def ended(end_step, results):
    """Run `end_step` now when eager (-> None), else -> a graph op that runs it once `results`
    exist."""
    if tf.executing_eagerly():
        end_step()
        return None

    def run(*_):
        end_step()
        return np.zeros(0, np.uint8)

    return tf.numpy_function(run, list(results), tf.uint8, stateful=True)


def at_step_end(out, end_step, results):
    """The step's last result, returned once the step has ended (every exchange of it done)."""
    done = ended(end_step, list(results) or [out])
    if done is None:
        return out
    with tf.control_dependencies([done]):
        return tf.identity(out)


def reducible(tensor):
    """Whether Horovod's own allreduce takes this dtype: not bfloat16 (a small bfloat16 gradient
    goes in float32)."""
    return tensor.dtype != tf.bfloat16


def carries_bfloat16(tensor):
    """Horovod's TensorFlow allreduce takes no bfloat16 anywhere (its op's types: integers,
    half, float, double)."""
    return False


def native_wire(tensor, fallback):
    return tf.cast(tensor, tf.as_dtype(fallback.value))


def native_result(reduced, like):
    return tf.cast(reduced, like.dtype)


# wire="values" ------------------------------------------------------------------------------------
def compress_values(tensor, exchanger, process_set=None):
    x = tf.cast(tensor, tf.float32)
    process_set = process_set or hvd.global_process_set
    local = tf.numpy_function(lambda a: _metadata.vector(exchanger.config, [codec.amax(a)], [a.size]), [x], tf.float64,
                              stateful=True)
    local.set_shape([3 + _metadata.TIMING + _metadata.TAIL])
    agreed = hvd.allreduce(local, op=hvd.Max, process_set=process_set)
    size, rank_now, name = process_set.size(), process_set.rank(), label(tensor)

    def to_wire(a, g):
        amax = float(_metadata.read(exchanger.config, g, [a.size], [name])[0][0])
        seed = exchanger.state.values_seed(rank_now, name)
        wire, shift = _values.to_wire(exchanger.config, exchanger.recorder, a, amax, size, seed, name)
        return wire.reshape(a.shape), np.int32(shift)

    carrier = tf.as_dtype(_values.carrier(exchanger.config.fmt))
    wire, shift = tf.numpy_function(to_wire, [x, agreed], [carrier, tf.int32], stateful=True)
    wire.set_shape(tensor.shape)
    return wire, (shift, tensor.dtype, name)


def decompress_values(tensor, ctx, exchanger):
    shift, dtype, name = ctx

    def from_wire(w, s):
        exchanger.state.values_done(name)
        return _values.from_wire(w, s).reshape(w.shape)

    out = tf.numpy_function(from_wire, [tensor, shift], tf.float32, stateful=True)
    out.set_shape(tensor.shape)
    return tf.cast(out, dtype)
