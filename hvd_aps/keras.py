"""Keras 3 data parallelism over horovod.tensorflow that really averages.

horovod.tensorflow.keras.DistributedOptimizer predates Keras 3: under Keras 3 it never calls the
compressor and leaves every rank with its own weights. This wrapper allreduces the gradients in
`apply`, which both `model.fit` and `apply_gradients` go through.
"""
import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from .compressor import APSCompressor
from .tensorflow import allreduce_codes
from .config import Wire


def _zeros_where_missing(grads, variables):
    """A None gradient (a variable this rank's loss did not reach, e.g. a head only another rank
    uses) as zeros, as Horovod's torch optimizer sends at synchronize(): every rank then hands the
    allreduce the same tensors. Left out on one rank only, Horovod's own allreduces wait for ever
    for it, and the codes' buckets differ in size (Horovod refuses their mismatched shapes).
    Gradients that do not match the variables one to one stay as they are: Keras's own apply
    refuses them."""
    if len(grads) != len(variables):
        return list(grads)
    return [_zeros_like(v) if g is None else g for g, v in zip(grads, variables)]


def _zeros_like(variable):
    """Zeros computed from the variable's value, so that TensorFlow cannot fold them into a
    constant: its constant folding runs Horovod's allreduce (an op it takes for stateless) of
    tf.zeros once, when the graph is built, and never again, while the other ranks wait for it
    every step. multiply_no_nan gives zeros where the value is Inf or NaN too."""
    value = tf.convert_to_tensor(variable.value)
    return tf.math.multiply_no_nan(value, tf.zeros([], value.dtype))


class _Distributed:
    def apply(self, grads, trainable_variables=None):
        grads = _zeros_where_missing(grads, self._trainable_variables if trainable_variables is None
                                     else list(trainable_variables))
        if self._hvd_sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return super().apply(self._allreduced(grads), trainable_variables)

    def _allreduced(self, grads):
        """Dense gradients as codes in buckets where the compression sends codes; the rest (all of
        them otherwise, IndexedSlices always) through Horovod's allreduce, which allgathers
        IndexedSlices uncompressed."""
        present = [i for i, g in enumerate(grads) if g is not None]
        coded = [i for i in present if self._sends_codes() and not isinstance(grads[i], tf.IndexedSlices)]
        if coded:
            for i, r in zip(coded, allreduce_codes([grads[i] for i in coded], self._hvd_compression, self._hvd_op)):
                grads[i] = r
        for i in sorted(set(present) - set(coded)):
            # named by position: Horovod's names from the graph's tensors differ where the ranks' graphs
            # do (IndexedSlices excepted: Horovod names their allgathers itself)
            grads[i] = hvd.allreduce(grads[i], op=self._hvd_op, compression=self._hvd_compression,
                                     name=f"hvd_aps.keras.grad{i}")
        return grads

    def _sends_codes(self):
        return isinstance(self._hvd_compression, APSCompressor) and self._hvd_compression.config.wire is Wire.CODES


def DistributedOptimizer(optimizer, compression=hvd.Compression.none, op=hvd.Average, sparse_as_dense=False):
    """A copy of the Keras 3 `optimizer` whose gradients are allreduced (averaged by default,
    through `compression`, e.g. hvd_aps.APSCompressor(hvd_aps.e4m3)) before they are applied. An
    APSCompressor sending codes gets its buckets (hvd_aps.tensorflow.allreduce_codes); any other
    compression goes through one Horovod allreduce per gradient. A gradient that is None on this
    rank goes as zeros, so a variable another rank's loss reaches trains everywhere alike.

    TF IndexedSlices (an Embedding's gradient) go as Horovod sends them, through its allgather
    uncompressed; with sparse_as_dense=True (Horovod's option of that name) they are densified
    first, and then sent as codes like any gradient.

    Mixed precision: under the "mixed_float16" global policy (or given a LossScaleOptimizer) the
    loss scaling sits inside the copy, after the allreduce: every rank then checks the same
    averaged gradients for Inf/NaN (a non-finite gradient on one rank reaches all as NaN) and
    skips or applies the same step. Left to model.compile(), the scaling would wrap the copy and
    each rank would decide alone whether to allreduce at all."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras 3 optimizer, got {type(optimizer).__name__}")
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    cls = type(f"Distributed{type(optimizer).__name__}", (_Distributed, type(optimizer)), {})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._hvd_compression, wrapped._hvd_op, wrapped._hvd_sparse_as_dense = compression, op, sparse_as_dense
    return wrapped


def broadcast_variables(variables, root_rank=0):
    """Give every rank root_rank's values (Keras 3 variables lack the .ref() Horovod's helper needs)."""
    for i, v in enumerate(variables):
        v.assign(hvd.broadcast(v.value, root_rank, name=f"hvd_aps.broadcast.{i}"))


class BroadcastInitialState(keras.callbacks.Callback):
    """Keras callback: start every rank from rank root_rank's weights."""

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs=None):
        broadcast_variables(self.model.variables, self.root_rank)


class FidelityLogger(keras.callbacks.Callback):
    """Keras callback: after every `every` batches, the compressor's fidelity of the last step
    (hvd_aps.dashboard: relative error, flushed and saturated shares, bytes sent, each bucket's APS
    shift) to TensorBoard event files under log_dir, on rank 0 (every_rank: each rank its own)."""

    def __init__(self, compressor: APSCompressor, log_dir: str, every: int = 1, every_rank: bool = False):
        super().__init__()
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (batches between writes), got {every!r}")
        self.compressor, self.log_dir, self.every, self.every_rank = compressor, log_dir, every, every_rank
        self._writer, self._batches = None, 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        self.compressor.log_to(self._writer, self._batches, every_rank=self.every_rank)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
