"""Run under `horovodrun -np 3 --gloo`: Horovod's TensorFlow tape as its users turn it on, each
scenario twice, with Horovod's Compression.none and with APSCompressor (every gradient as codes).
Each rank saves every run's final variables (or its error) to OUTDIR/tfdropin_rank<r>.npz for
tests/test_dropin.py."""
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvd_aps

hvd.init(process_sets="dynamic")
rank, out = hvd.rank(), {}
STEPS = 3
pair = hvd.add_process_set([0, 1])  # a set without the last rank


def train(compression, process_set=hvd.global_process_set):
    """SGD through Horovod's tape on a linear model beside a variable no rank uses (its gradient
    None everywhere) -> the final variables, flat."""
    w = tf.Variable(np.random.default_rng(0).normal(size=(20, 10)).astype(np.float32))
    unused = tf.Variable(np.zeros(7, np.float32))
    data = np.random.default_rng(1 + rank)
    for _ in range(STEPS):
        x = tf.constant(data.normal(size=(16, 20)), tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ w - 1.0))
        tape = hvd.DistributedGradientTape(tape, compression=compression, num_groups=1, process_set=process_set)
        for v, g in zip((w, unused), tape.gradient(loss, [w, unused])):
            if g is not None:
                v.assign_sub(0.02 * g)
    return np.concatenate([w.numpy().ravel(), unused.numpy()])


def outcome(run, fn):
    try:
        out[run] = fn()
    except Exception as err:  # the outcome itself: both ways of running must agree on it
        out[f"{run}_error"] = np.array(f"{type(err).__name__}: {err}")


for run, make in (("stock", lambda: hvd.Compression.none),
                  ("codes", lambda: hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0))):
    outcome(f"tf_none_{run}", lambda: train(make()))
    outcome(f"tf_pair_{run}", lambda: train(make(), process_set=pair) if rank < 2 else np.zeros(1))
np.savez(f"{sys.argv[1]}/tfdropin_rank{rank}.npz", **out)
hvd.allreduce(tf.constant(0.0), name="done")  # a rank that ends shuts Horovod down for the others
