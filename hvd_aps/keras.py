"""Keras 3 data parallelism over horovod.tensorflow that really averages.

horovod.tensorflow.keras.DistributedOptimizer predates Keras 3: under Keras 3 it never calls the
compressor and leaves every rank with its own weights. This wrapper allreduces the gradients in
`apply`, which both `model.fit` and `apply_gradients` go through.
"""
import horovod.tensorflow as hvd
import keras

from .tensorflow import allreduce_codes


class _Distributed:
    def apply(self, grads, trainable_variables=None):
        present = [i for i, g in enumerate(grads) if g is not None]
        if self._hvd_codes:
            reduced = allreduce_codes([grads[i] for i in present], self._hvd_compression, self._hvd_op,
                                      **self._hvd_codes)
        else:
            reduced = [hvd.allreduce(grads[i], op=self._hvd_op, compression=self._hvd_compression) for i in present]
        grads = list(grads)
        for i, r in zip(present, reduced):
            grads[i] = r
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(optimizer, compression=hvd.Compression.none, op=hvd.Average, codes=False,
                         bucket_bytes=16 << 20, min_elements=4096):
    """A copy of the Keras 3 `optimizer` whose gradients are allreduced (averaged by default,
    through `compression`, e.g. hvd_aps.APSCompressor(hvd_aps.e4m3)) before they are applied.
    codes=True sends the APS codes themselves (hvd_aps.tensorflow.allreduce_codes) instead of
    Horovod's stock allreduce of float16 values; bucket_bytes and min_elements apply to it."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras 3 optimizer, got {type(optimizer).__name__}")
    cls = type(f"Distributed{type(optimizer).__name__}", (_Distributed, type(optimizer)), {})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._hvd_compression, wrapped._hvd_op = compression, op
    wrapped._hvd_codes = dict(bucket_bytes=bucket_bytes, min_elements=min_elements) if codes else None
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
