"""Resume bit for bit through TensorFlow's tape (tests/test_resume.py), three times (mode in
HVD_APS_MODE): `straight` trains STEPS steps through hvd.DistributedGradientTape with an
APSCompressor, `first` trains STEPS // 2 and saves per rank the weights and the compressor's
state_dict, `second`, a fresh process, loads them and trains the rest. Run under horovodrun -np 2
--gloo, or by tests/hosts_run.py as 2 hosts x 2 ranks (two levels). Plain SGD (w -= lr * g), so
the weights and the compressor are the whole state. Each rank saves OUTDIR/tf_<mode>_rank<r>.npz."""
import os
import pickle
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_aps

STEPS, WIDTH, LR = 8, 128, 0.05
SETTINGS = {"feedback": dict(error_feedback=True), "stochastic": dict(rounding="stochastic", seed=11)}

hvd.init()
rank = hvd.rank()
outdir, mode = sys.argv[1], os.environ["HVD_APS_MODE"]


def train(setting, steps, checkpoint=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH, activation="tanh"),
                              keras.layers.Dense(WIDTH)])
    compressor = hvd_aps.APSCompressor("e3m0", min_elements=0, **SETTINGS[setting])
    if checkpoint is not None:
        with open(checkpoint, "rb") as saved:
            weights, state = pickle.load(saved)
        model.set_weights(weights)
        compressor.load_state_dict(state)
    for step in steps:
        gen = np.random.default_rng(1000 * step + rank)
        x, y = gen.normal(size=(16, WIDTH)).astype(np.float32), gen.normal(size=(16, WIDTH)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, compression=compressor, num_groups=1)
        for var, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            var.assign_sub(LR * grad)
    return model, compressor


out = {}
for setting in SETTINGS:
    path = f"{outdir}/tf_{setting}_rank{rank}.pkl"
    if mode == "straight":
        model, _ = train(setting, range(STEPS))
    elif mode == "first":
        model, compressor = train(setting, range(STEPS // 2))
        with open(path, "wb") as saved:
            pickle.dump((model.get_weights(), compressor.state_dict()), saved)
    else:
        model, _ = train(setting, range(STEPS // 2, STEPS), checkpoint=path)
    out[setting] = np.concatenate([w.ravel() for w in model.get_weights()])
np.savez(f"{outdir}/tf_{mode}_rank{rank}.npz", **out)
