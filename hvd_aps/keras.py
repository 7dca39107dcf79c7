"""Keras 3 data parallelism over horovod.tensorflow that really averages.

horovod.tensorflow.keras.DistributedOptimizer predates Keras 3: under Keras 3 it never calls the
compressor and leaves every rank with its own weights. This wrapper allreduces the gradients in
`apply`, which both `model.fit` and `apply_gradients` go through.
"""
import horovod.tensorflow as hvd
import keras

from .compressor import APSCompressor
from .tensorflow import allreduce_codes


class _Distributed:
    def apply(self, grads, trainable_variables=None):
        present = [i for i, g in enumerate(grads) if g is not None]
        if isinstance(self._hvd_compression, APSCompressor) and self._hvd_compression.config.wire == "codes":
            reduced = allreduce_codes([grads[i] for i in present], self._hvd_compression, self._hvd_op)
        else:
            reduced = [hvd.allreduce(grads[i], op=self._hvd_op, compression=self._hvd_compression) for i in present]
        grads = list(grads)
        for i, r in zip(present, reduced):
            grads[i] = r
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(optimizer, compression=hvd.Compression.none, op=hvd.Average):
    """A copy of the Keras 3 `optimizer` whose gradients are allreduced (averaged by default,
    through `compression`, e.g. hvd_aps.APSCompressor(hvd_aps.e4m3)) before they are applied. An
    APSCompressor sending codes gets its buckets (hvd_aps.tensorflow.allreduce_codes); any other
    compression goes through one Horovod allreduce per gradient.

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
    wrapped._hvd_compression, wrapped._hvd_op = compression, op
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
