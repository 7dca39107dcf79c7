"""Run under `horovodrun -np 2 --gloo`: APSCompressor through horovod.tensorflow and the Keras 3
wrapper; each rank saves what it got to OUTDIR/tf_rank<r>.npz for tests/test_horovod_tensorflow.py."""
import sys
import warnings

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_aps
import hvd_aps.keras
import hvd_aps.tensorflow
from common import KERAS_LR, KERAS_W0, codes_grads, keras_data, poisoned, rank_data

hvd.init()
rank, out = hvd.rank(), {}
e4m3 = hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=16)
values = hvd_aps.APSCompressor(hvd_aps.e4m3, wire="values")


def reduce(x, comp, op=hvd.Average):
    return hvd.allreduce(tf.constant(x), op=op, compression=comp).numpy()


@tf.function
def reduce_in_graph(x, comp):
    return hvd.allreduce(x, op=hvd.Average, compression=comp)


out["avg_eager"] = reduce(rank_data(rank), e4m3)
out["avg_graph"] = reduce_in_graph(tf.constant(rank_data(rank)), e4m3).numpy()
out["values_eager"] = reduce(rank_data(rank), values)
out["values_graph"] = reduce_in_graph(tf.constant(rank_data(rank)), values).numpy()
out["naive"] = reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3", scaling="none", min_elements=16))
grouped = tf.function(lambda xs: hvd.grouped_allreduce(xs, op=hvd.Sum, compression=e4m3))
for i, g in enumerate(grouped([tf.constant(g) for g in codes_grads(rank)])):
    out[f"grouped_sum_{i}"] = g.numpy()
out["zeros"] = reduce(np.zeros(100, np.float32), e4m3)
out["nan"] = reduce(poisoned(rank, np.nan), e4m3)
out["f16_dtype_ok"] = np.array(hvd.allreduce(tf.constant(rank_data(rank), tf.float16), compression=e4m3).dtype == tf.float16)


def one_by_one_warned(groups):
    """Whether Horovod's tape over three gradients warns that they are exchanged one at a time."""
    weights = [tf.Variable(tf.ones([5000]) * k) for k in range(3)]  # above min_elements: batched
    comp = hvd_aps.APSCompressor(hvd_aps.e4m3)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(w * w) for w in weights])
        return hvd.DistributedGradientTape(tape, compression=comp, num_groups=groups).gradient(loss, weights)

    hvd_aps._batches._warn_one_by_one.cache_clear()  # once a process: the allreduce calls above warned already
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    return any("num_groups=1" in str(w.message) for w in caught)


out["one_by_one_warned"] = np.array([one_by_one_warned(1), one_by_one_warned(0)])


def tape_training(use_function, codes=False):
    w = tf.Variable(tf.linspace(-1.0, 1.0, 10)[:, None])
    b = tf.Variable([0.5])

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(xb, w) + b - yb) ** 2)
        wrapped = (hvd_aps.tensorflow.DistributedGradientTape(tape, hvd_aps.APSCompressor("e4m3", min_elements=1))
                   if codes else hvd.DistributedGradientTape(tape, compression=e4m3, gradient_predivide_factor=2.0))
        grads = wrapped.gradient(loss, [w, b])
        for v, g in zip([w, b], grads):
            v.assign_sub(0.1 * g)

    step = tf.function(step) if use_function else step
    rng = np.random.default_rng(rank)
    for _ in range(3):
        step(rng.normal(size=(8, 10)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
    return np.concatenate([w.numpy().ravel(), b.numpy()])


out["tape_graph"] = tape_training(True)
out["tape_eager"] = tape_training(False)
out["tape_codes_graph"] = tape_training(True, codes=True)

v1_w = tf.Variable(tf.ones([4, 1]))
v1 = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=e4m3)
xb, yb = keras_data(rank)
for _ in range(2):
    v1.minimize(lambda: tf.reduce_mean((tf.matmul(xb, v1_w) - yb) ** 2), var_list=[v1_w])
out["v1_optimizer"] = v1_w.numpy().ravel()


def keras_step(compression, log_dir=None):
    """One fit of a batch; with log_dir, the compressor's fidelity to TensorBoard there
    (hvd_aps.keras.FidelityLogger, rank 0)."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.set_weights([KERAS_W0 * (rank + 1), np.array([rank], np.float32)])  # rank 0's must win
    opt = hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(KERAS_LR), compression=compression)
    model.compile(optimizer=opt, loss="mse")
    x, y = keras_data(rank)
    callbacks = [hvd_aps.keras.BroadcastInitialState()]
    if log_dir is not None:
        callbacks.append(hvd_aps.keras.FidelityLogger(compression, log_dir))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, callbacks=callbacks)
    return np.concatenate([w.ravel() for w in model.get_weights()])


# Codes on the wire: the same tensors as the torch codes test, eagerly and in a graph
for fmt in ("e4m3", "e2m1fn"):
    grads = [tf.constant(g) for g in codes_grads(rank)]
    for i, g in enumerate(hvd_aps.tensorflow.allreduce_codes(grads, hvd_aps.APSCompressor(fmt, min_elements=16))):
        out[f"codes_{fmt}_{i}"] = g.numpy()
graph_codes = tf.function(lambda gs: hvd_aps.tensorflow.allreduce_codes(gs, e4m3, name="g"))
for i, g in enumerate(graph_codes([tf.constant(g) for g in codes_grads(rank)])):
    out[f"codes_graph_{i}"] = g.numpy()
chunked = hvd_aps.APSCompressor("e4m3", min_elements=16, chunk_bytes=4 * 700)  # 4 chunks, pipelined in the graph
chunked_codes = tf.function(lambda gs: hvd_aps.tensorflow.allreduce_codes(gs, chunked, name="c"))
for i, g in enumerate(chunked_codes([tf.constant(g) for g in codes_grads(rank)])):
    out[f"codes_chunked_{i}"] = g.numpy()
nonfinite = codes_grads(rank)
nonfinite[0][3] = np.nan if rank == 1 else nonfinite[0][3]
out["codes_nan"] = hvd_aps.tensorflow.allreduce_codes([tf.constant(g) for g in nonfinite], e4m3, name="nan")[0].numpy()
single = tf.Variable(tf.ones([5000]))
with tf.GradientTape() as tape:  # one variable, so one tensor in the bucket
    loss = tf.reduce_sum(single * float(rank + 1))
out["single_variable"] = hvd_aps.tensorflow.DistributedGradientTape(tape, e4m3).gradient(loss, single).numpy()


def low_precision():
    """Gradients held in bfloat16 and float16: Horovod's own grouped allreduce with the compressor
    (in a graph) and the codes path; the results in float32 for the test, with their dtypes."""
    for dtype in (tf.bfloat16, tf.float16):
        grads = [tf.cast(tf.constant(g), dtype) for g in codes_grads(rank)]
        horovods = tf.function(lambda gs: hvd.grouped_allreduce(gs, op=hvd.Average, compression=e4m3))(grads)
        codes = hvd_aps.tensorflow.allreduce_codes(grads, e4m3, name=f"low_{dtype.name}")
        for path, results in (("grouped", horovods), ("codes", codes)):
            for i, g in enumerate(results):
                out[f"{path}_{dtype.name}_{i}"] = tf.cast(g, tf.float32).numpy()
            out[f"{path}_{dtype.name}_dtype_ok"] = np.array(all(g.dtype == dtype for g in results))


low_precision()


def auto_policy():
    """policy="auto" with the framework's path pinned, through the tape's exchange: the bucket in
    Horovod's own allreduce in the fallback dtype; a bfloat16 fallback, which Horovod's
    TensorFlow ops do not carry, refused at the first exchange on both paths."""
    x = rank_data(rank, seed=9)
    for fallback in ("float32", "float16"):
        comp = hvd_aps.APSCompressor("e4m3", policy="auto", fallback=fallback, min_elements=16, chunk_bytes=0)
        comp.pin({"policy": "native"})
        out[f"tape_native_{fallback}"] = hvd_aps.tensorflow.allreduce_codes([tf.constant(x)], comp)[0].numpy()
        out[f"tape_native_{fallback}_bytes"] = np.array(comp.bytes_sent)
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", fallback="bfloat16", min_elements=16)
    for path, call in (("tape", lambda: hvd_aps.tensorflow.allreduce_codes([tf.constant(x)], comp)),
                       ("line", lambda: hvd.allreduce(tf.constant(x), compression=comp, name="bfloat16"))):
        try:
            call()
            out[f"{path}_bfloat16_refused"] = np.array(False)
        except ValueError as err:
            out[f"{path}_bfloat16_refused"] = np.array("fallback='float16'" in str(err))


auto_policy()


def keras_mixed_float16(key, data_scales):
    """Keras mixed precision (float16 compute, loss scaling from 2**15) through the wrapper, two
    steps, rank r's data scaled by data_scales[r]: small data keep every scaled gradient finite;
    large ones on rank 1 alone overflow float16 there and nowhere else, and every rank must then
    skip both steps alike (and halve its loss scale twice)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.set_weights([KERAS_W0 * (rank + 1), np.array([rank], np.float32)])
        opt = hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(KERAS_LR), hvd_aps.APSCompressor("e4m3", min_elements=1))
        model.compile(optimizer=opt, loss="mse")
        x, y = keras_data(rank)
        model.fit(x * data_scales[rank], y * data_scales[rank], batch_size=len(x) // 2, epochs=1, verbose=0,
                  shuffle=False, callbacks=[hvd_aps.keras.BroadcastInitialState()])
        out[key] = np.concatenate([w.ravel() for w in model.get_weights()])
        out[f"{key}_scale"] = np.array(float(model.optimizer.dynamic_scale.numpy()))
        out[f"{key}_wrapped"] = np.array(isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer))
    finally:
        keras.mixed_precision.set_global_policy("float32")


keras_mixed_float16("mixed_finite", (1e-3, 1e-3))
keras_mixed_float16("mixed_overflow", (1e-3, 1e4))

out["keras_none"] = keras_step(hvd.Compression.none)
out["keras_codes"] = keras_step(hvd_aps.APSCompressor("e4m3", min_elements=1), f"{sys.argv[1]}/tb_keras/rank{rank}")
out["keras_values"] = keras_step(hvd_aps.APSCompressor("e4m3", wire="values"))

def keras3_with_horovods_tape():
    """Horovod's own TF2 API on a Keras 3 model (the installer's patches): broadcast_variables of
    model.variables, then hvd.DistributedGradientTape with an APSCompressor inside tf.function."""
    keras.utils.set_random_seed(rank)  # other weights on every rank: the broadcast must fix that
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)])
    hvd.broadcast_variables(model.variables, root_rank=0)
    out["keras3_broadcast"] = np.concatenate([v.numpy().ravel() for v in model.variables])
    comp = hvd_aps.APSCompressor("e4m3", min_elements=16)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(0.1 * g)

    x, y = keras_data(rank)
    for _ in range(3):
        step(x, y)
    out["keras3_tape"] = np.concatenate([v.numpy().ravel() for v in model.variables])


keras3_with_horovods_tape()

try:
    reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3" if rank == 0 else "e5m2", min_elements=16))
    out["mismatch"] = np.array("no error")
except (ValueError, tf.errors.OpError) as err:  # eager re-raises the ValueError itself
    out["mismatch"] = np.array(str(err))

np.savez(f"{sys.argv[1]}/tf_rank{rank}.npz", **out)
