"""Run under `horovodrun -np 2 --gloo`: Keras 3 as its users train it, through
hvd_aps.keras.DistributedOptimizer, and an Embedding's IndexedSlices through Horovod's tape; each
scenario twice, with Horovod's Compression.none and with APSCompressor (every gradient as codes).
Each rank saves every run's weights (or its error) to OUTDIR/kerasdropin_rank<r>.npz for
tests/test_dropin.py. A run that outlasts RUN_LIMIT_S ends the process with every thread's stack:
a hang fails the test with where it waited."""
import faulthandler
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_aps
import hvd_aps.keras
from common import KERAS_FEATURES as FEATURES, KERAS_HIDDEN as HIDDEN, KERAS_VOCAB as VOCAB, KERAS_WIDTH as WIDTH
from two_heads import save_outcome

RUN_LIMIT_S = 60
ROWS, BATCH, LR, TOKENS = 32, 16, 0.05, 3  # two steps an epoch

hvd.init()
rank, out = hvd.rank(), {}


def data():
    """Rows of this rank's own, a linear target."""
    x = np.random.default_rng(10 + rank).normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, 0.5 * x.sum(1, keepdims=True)


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def mlp():
    """A trunk and an output layer, the same initial weights on every rank."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh", name="trunk"),
                             keras.layers.Dense(1, name="out")])


def fit(model, compression, **options):
    """compile with a fresh wrapper over SGD (Keras builds an optimizer for one set of trainable
    variables), then one epoch of this rank's rows, as a user's script does."""
    model.compile(optimizer=hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression,
                                                               **options), loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd_aps.keras.BroadcastInitialState()])
    return flat(model)


def frozen(compression):
    """The trunk frozen before compile -> the weights before and after fit."""
    model = mlp()
    model.get_layer("trunk").trainable = False
    return np.stack([flat(model), fit(model, compression)])


def toggled(compression):
    """Fit with the trunk frozen, unfreeze it, recompile, fit again (the same compressor) -> the
    weights before, after the first and after the second fit."""
    model = mlp()
    model.get_layer("trunk").trainable = False
    start, first = flat(model), fit(model, compression)
    model.get_layer("trunk").trainable = True
    return np.stack([start, first, fit(model, compression)])


def toggled_same_optimizer(compression):
    """Recompiled with the optimizer of the first fit: Keras refuses the unfrozen trunk's variables."""
    model = mlp()
    model.get_layer("trunk").trainable = False
    opt = hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression)
    x, y = data()
    for trainable in (False, True):
        model.get_layer("trunk").trainable = trainable
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return flat(model)


class OneRankHead(keras.Model):
    """The trunk and output of mlp(), and a head only rank 1's loss reaches (through add_loss):
    on rank 0 Keras's gradients for the head are None."""

    def __init__(self):
        super().__init__()
        self.trunk = keras.layers.Dense(HIDDEN, activation="tanh")
        self.out, self.head = keras.layers.Dense(1), keras.layers.Dense(1)

    def build(self, shape):
        self.trunk.build(shape)
        self.out.build((None, HIDDEN))
        self.head.build((None, HIDDEN))

    def call(self, x):
        h = self.trunk(x)
        if rank == 1:
            self.add_loss(tf.reduce_mean(tf.square(self.head(h) - 1.0)))
        return self.out(h)


def one_rank_head(compression):
    """-> the weights before and after fit; the head's last."""
    keras.utils.set_random_seed(0)
    model = OneRankHead()
    model.build((None, FEATURES))
    return np.stack([flat(model), fit(model, compression)])


def tokens():
    """Token ids of this rank's own: each rank touches rows of the table the other does not."""
    return np.random.default_rng(20 + rank).integers(0, VOCAB, size=(ROWS, TOKENS)).astype(np.int32)


def embedding_fit(compression, sparse_as_dense=False):
    """An Embedding (its gradient IndexedSlices) under a Dense layer through model.fit -> the
    weights (the table first) before, after the first step and after the epoch."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((TOKENS,), dtype="int32"), keras.layers.Embedding(VOCAB, WIDTH),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_aps.keras.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression,
                                                               sparse_as_dense=sparse_as_dense), loss="mse")
    start, after_first = flat(model), []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: after_first.append(flat(model)) if batch == 0 else None)
    x = tokens()
    model.fit(x, np.cos(x.sum(1, keepdims=True)).astype(np.float32), batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    return np.stack([start, after_first[0], flat(model)])


def embedding_tape(compression, sparse_as_dense=False):
    """Two steps through Horovod's tape (num_groups=1, inside tf.function) on an Embedding and a
    Dense weight -> the variables (the table first) before, after the first and after the second
    step; and whether the table's averaged gradient came back as IndexedSlices."""
    keras.utils.set_random_seed(0)
    table = keras.layers.Embedding(VOCAB, WIDTH)
    table.build((None, TOKENS))
    dense = tf.Variable(np.linspace(-1, 1, WIDTH, dtype=np.float32)[:, None])
    x, variables, kinds = tf.constant(tokens()), [table.embeddings, dense], []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(table(x), 1) @ dense - 1.0))
        tape = hvd.DistributedGradientTape(tape, compression=compression, num_groups=1,
                                           sparse_as_dense=sparse_as_dense)
        grads = tape.gradient(loss, variables)
        kinds.append(type(grads[0]).__name__)  # when traced
        for v, g in zip(variables, grads):
            v.assign_sub(LR * tf.convert_to_tensor(g))

    def values():
        return np.concatenate([v.numpy().ravel() for v in variables])

    rows = [values()]
    for _ in range(2):
        step()
        rows.append(values())
    return np.stack(rows), kinds[0] == "IndexedSlices"


def outcome(run, fn):
    """save_outcome, the run bounded by RUN_LIMIT_S."""
    faulthandler.dump_traceback_later(RUN_LIMIT_S, exit=True)
    try:
        save_outcome(out, run, fn)
    finally:
        faulthandler.cancel_dump_traceback_later()


def tape_outcome(run, compression, sparse_as_dense=False):
    """embedding_tape's variables as the run's outcome, whether the table's gradient came back
    sparse beside them."""
    def weights():
        result, sparse = embedding_tape(compression, sparse_as_dense)
        out[f"{run}_sparse"] = np.array(sparse)
        return result
    outcome(run, weights)


for run, make in (("stock", lambda: hvd.Compression.none),
                  ("codes", lambda: hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0))):
    outcome(f"keras_frozen_{run}", lambda: frozen(make()))
    outcome(f"keras_toggled_{run}", lambda: toggled(make()))
    outcome(f"keras_same_optimizer_{run}", lambda: toggled_same_optimizer(make()))
    outcome(f"keras_one_rank_head_{run}", lambda: one_rank_head(make()))
    outcome(f"keras_embedding_{run}", lambda: embedding_fit(make()))
    outcome(f"keras_embedding_dense_{run}", lambda: embedding_fit(make(), sparse_as_dense=True))
    tape_outcome(f"tape_embedding_{run}", make())
    tape_outcome(f"tape_embedding_dense_{run}", make(), sparse_as_dense=True)
np.savez(f"{sys.argv[1]}/kerasdropin_rank{rank}.npz", **out)
hvd.allreduce(tf.constant(0.0), name="done")  # a rank that ends shuts Horovod down for the others
