"""Resume bit for bit through TensorFlow's tape and Keras 3's model.fit (tests/test_resume.py),
twice (mode in HVD_APS_MODE): `straight` trains STEPS steps (the tape: through
hvd.DistributedGradientTape with an APSCompressor; fit: EPOCHS epochs through
hvd_aps.keras.DistributedOptimizer) and at half of them saves per rank the weights, the
optimizer's variables and the compressor's state_dict, `second`, a fresh process, loads them and
trains the rest. Run under horovodrun -np 2 --gloo, or by tests/hosts_run.py as 2 hosts x 2 ranks
(two levels). The tape takes plain SGD steps (w -= lr * g); fit runs Adam, whose moments and step
count travel in the optimizer's variables. For the tape's UNLOADED settings `second` also resumes
without the compressor's state (the negative control). Each rank saves
OUTDIR/tf_<mode>_rank<r>.npz; the straight runs also each step's gradients of this rank before the
exchange and what the exchange handed the update (<setting>_local, <setting>_delivered), and the
compressor's tensor names in the order it first exchanged them (<setting>_keys), which
tests/replay.py replays."""
import os
import pickle
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_aps
import hvd_aps.keras
from hvd_aps import _layout
from common import RESUME_TF as SETTINGS

STEPS, WIDTH, LR = 8, 128, 0.05
SIZES = [WIDTH * WIDTH, WIDTH, WIDTH * WIDTH, WIDTH]  # the two Dense layers' kernels and biases
EPOCHS, BATCH, BATCHES = 4, 16, 2  # fit: two batches an epoch, each rank its own rows, not shuffled
UNLOADED = ("feedback",)  # the tape resumed also without the compressor's state: it must end elsewhere

hvd.init()
rank = hvd.rank()
outdir, mode = sys.argv[1], os.environ["HVD_APS_MODE"]
STEPS_SEEN = {}  # "<prefix>_<setting>" -> [(this rank's gradients end to end, the exchange's results)] a step


def seen(key, local, delivered):
    STEPS_SEEN.setdefault(key, []).append((np.concatenate([np.ravel(g) for g in local]),
                                           [np.array(d) for d in delivered]))


def train(setting, steps, checkpoint=None, compressor_state=True, save=None):
    model, compressor = model_and_compressor(setting)
    recording = save is not None
    if checkpoint is not None:
        weights, state = load(checkpoint)
        model.set_weights(weights)
        if compressor_state:
            compressor.load_state_dict(state)
    for step in steps:
        if step == STEPS // 2 and save is not None:
            dump(save, (model.get_weights(), compressor.state_dict()))
        gen = np.random.default_rng(1000 * step + rank)
        x, y = gen.normal(size=(16, WIDTH)).astype(np.float32), gen.normal(size=(16, WIDTH)).astype(np.float32)
        with tf.GradientTape(persistent=recording) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        local = tape.gradient(loss, model.trainable_variables) if recording else None
        tape = hvd.DistributedGradientTape(tape, compression=compressor, num_groups=1)
        grads = tape.gradient(loss, model.trainable_variables)
        if recording:
            seen(f"tf_{setting}", [g.numpy() for g in local], [g.numpy() for g in grads])
        for var, grad in zip(model.trainable_variables, grads):
            var.assign_sub(LR * grad)
    return model, compressor


def model_and_compressor(setting):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(WIDTH, activation="tanh"),
                              keras.layers.Dense(WIDTH)])
    return model, hvd_aps.APSCompressor("e3m0", **SETTINGS[setting])


def fit(setting, epochs, checkpoint=None, save=None):
    """model.fit as a Keras user runs it; a checkpoint holds the weights, the optimizer's variables
    (Adam's moments and step count) and the compressor's state. save: fit to half the epochs,
    save the checkpoint there, fit the rest (as a user's checkpoint callback would)."""
    model, compressor = model_and_compressor(setting)
    opt = hvd_aps.keras.DistributedOptimizer(keras.optimizers.Adam(1e-3), compression=compressor)
    if save is not None:
        recorded(opt, f"keras_{setting}")
    model.compile(optimizer=opt, loss="mse")
    if checkpoint is not None:
        weights, optimizer_values, state = load(checkpoint)
        model.set_weights(weights)
        opt.build(model.trainable_variables)
        for variable, value in zip(opt.variables, optimizer_values, strict=True):
            variable.assign(value)
        compressor.load_state_dict(state)
    gen = np.random.default_rng(rank)
    x, y = (gen.normal(size=(BATCH * BATCHES, WIDTH)).astype(np.float32) for _ in range(2))
    spans = [range(epochs.start, EPOCHS // 2), range(EPOCHS // 2, epochs.stop)] if save is not None else [epochs]
    for span in spans:
        if span.start == EPOCHS // 2 and save is not None:
            dump(save, (model.get_weights(), [v.numpy() for v in opt.variables], compressor.state_dict()))
        model.fit(x, y, batch_size=BATCH, epochs=span.stop, initial_epoch=span.start, shuffle=False, verbose=0,
                  callbacks=[hvd_aps.keras.BroadcastInitialState()])
    return model, compressor


def recorded(opt, key):
    """opt's exchange with each step's gradients before and after it kept (seen), inside fit's graph."""
    exchange = opt._allreduced

    def allreduced(grads):
        local = list(grads)
        out = exchange(list(grads))

        def keep(*arrays):
            seen(key, arrays[:len(local)], arrays[len(local):])
            return np.int32(0)
        kept = tf.numpy_function(keep, local + out, tf.int32, stateful=True)
        with tf.control_dependencies([kept]):
            return [tf.identity(g) for g in out]
    opt._allreduced = allreduced


def dump(path, checkpoint):
    with open(path, "wb") as saved:
        pickle.dump(checkpoint, saved)


def load(path):
    with open(path, "rb") as saved:
        return pickle.load(saved)


def final_weights(run, prefix, total, unloaded=()):
    """Each setting's final weights on this rank after `run` (train or fit) over `total` steps or
    epochs: straight (saving a checkpoint at half), or the second half from it; `second` also
    resumes the `unloaded` settings without the compressor's state."""
    weights = {}
    for setting in SETTINGS:
        path = f"{outdir}/{prefix}_{setting}_rank{rank}.pkl"
        if mode == "straight":
            model, compressor = run(setting, range(total), save=path)
            weights[f"{setting}_keys"] = np.array(names(prefix, compressor))
            weights[f"{setting}_local"] = np.stack([local for local, _ in STEPS_SEEN[f"{prefix}_{setting}"]])
            weights[f"{setting}_delivered"] = np.stack([np.concatenate([d.ravel() for d in delivered])
                                                        for _, delivered in STEPS_SEEN[f"{prefix}_{setting}"]])
        else:
            model, _ = run(setting, range(total // 2, total), checkpoint=path)
            if setting in unloaded:
                weights[f"{setting}_unloaded"] = flat(run(setting, range(total // 2, total), path, False)[0])
        weights[setting] = flat(model)
    return weights


def names(prefix, compressor):
    """The compressor's names of the model's gradients, in the model's order (stochastic rounding
    draws from them): the tape's one batch names them by position ("hvd_aps.0[i]"), Keras's
    allreduce_codes as hvd_aps._layout.buckets lays them out ("hvd_aps.bucket<b>[<j>]", last
    gradients first)."""
    seen = list(compressor.state_dict()["steps"])
    if prefix == "tf":
        return sorted(seen, key=lambda key: int(key[key.rindex("[") + 1:-1]))
    config, keys = compressor.config, {}
    for b, members in enumerate(_layout.buckets(SIZES, config.bucket_bytes, config.min_elements)[0]):
        keys.update({i: f"hvd_aps.bucket{b}[{j}]" for j, i in enumerate(members)})
    assert sorted(keys.values()) == sorted(seen), (keys, seen)
    return [keys[i] for i in range(len(SIZES))]


def flat(model):
    """A Keras model's weights end to end, one array."""
    return np.concatenate([w.ravel() for w in model.get_weights()])


out = {f"keras_{setting}": w for setting, w in final_weights(fit, "keras", EPOCHS).items()}
out.update(final_weights(train, "tf", STEPS, UNLOADED))
np.savez(f"{outdir}/tf_{mode}_rank{rank}.npz", **out)
