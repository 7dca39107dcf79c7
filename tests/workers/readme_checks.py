"""The README's code blocks, executed as written under 2 real ranks.

    horovodrun -np 2 --gloo python readme_checks.py horovod-torch OUTDIR       (the one line, hvd_aps.torch)
    horovodrun -np 2 --gloo python readme_checks.py horovod-tensorflow OUTDIR  (the tape, Keras 3)
    torchrun --nproc-per-node 2 readme_checks.py torchrun OUTDIR               (DDP, FSDP2)

Each block is read from README.md by the name in the `<!-- readme-test: NAME -->` line above it and
run in a namespace holding what it refers to (hvd, hvd_aps, a model, an optimizer, a tape); then one
step runs, and each rank saves OUTDIR/readme_<launch>_rank<r>.npz: per block the gradients it
produced and every rank's own float32 gradients (for their mean) or, for Keras, the weights;
under Horovod also whether its MPI controller carried the run (`controller_mpi`).
"""
import pathlib
import re
import sys

import numpy as np

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
TAG = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```[a-z]*\n(.*?)```", re.S)
SAMPLES, FEATURES, HIDDEN, OUTPUTS = 16, 32, 256, 16  # the first layer's weight is over min_elements


def blocks() -> dict:
    """name -> the code of every tagged fenced block in README.md."""
    return dict(TAG.findall(README.read_text()))


def rank_batch(rank: int):
    rng = np.random.default_rng(100 + rank)
    x, y = rng.normal(size=(SAMPLES, FEATURES)), rng.normal(size=(SAMPLES, OUTPUTS))
    return x.astype(np.float32), y.astype(np.float32)


def torch_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS))


def torch_step(model, opt, rank: int) -> tuple:
    """One step of `model` under `opt`: (the gradients the step used, this rank's own)."""
    import torch
    x, y = (torch.from_numpy(a) for a in rank_batch(rank))
    alone = torch_model()  # the same initial weights on every rank
    own = torch.autograd.grad(torch.nn.functional.mse_loss(alone(x), y), alone.parameters())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return flat(grads), flat(own)


def flat(tensors) -> np.ndarray:
    """torch tensors, TF tensors or Keras variables, end to end as one float32 array."""
    return np.concatenate([np.asarray(t.detach() if hasattr(t, "detach") else t).ravel() for t in tensors])


def horovod_torch(code: dict, out: dict) -> int:
    import horovod.torch as hvd
    import torch

    import hvd_aps
    hvd.init()
    torch.set_num_threads(1)
    for name in ("horovod-torch", "codes-optimizer"):
        model = torch_model()
        scope = {"hvd": hvd, "hvd_aps": hvd_aps, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
        exec(code[name], scope)
        out[f"{name}_grads"], out[f"{name}_own"] = torch_step(model, scope["opt"], hvd.rank())
    out["controller_mpi"], rank = np.array(hvd.mpi_enabled()), hvd.rank()
    hvd.shutdown()
    return rank


def horovod_tensorflow(code: dict, out: dict) -> int:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_aps
    hvd.init()
    keras.utils.set_random_seed(0)  # the same initial weights in every run (the launchers' runs are compared)
    x, y = rank_batch(hvd.rank())
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                              keras.layers.Dense(OUTPUTS)])
    with tf.GradientTape(persistent=True) as tape:  # read twice: alone, then through the block's wrapper
        loss = tf.reduce_mean(tf.square(model(x) - y))
    own = tape.gradient(loss, model.trainable_variables)
    scope = {"hvd": hvd, "hvd_aps": hvd_aps, "tape": tape}
    exec(code["horovod-tensorflow"], scope)
    out["horovod-tensorflow_grads"] = flat(scope["tape"].gradient(loss, model.trainable_variables))
    out["horovod-tensorflow_own"] = flat(own)

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                              keras.layers.Dense(OUTPUTS)])
    before = flat(model.trainable_variables)
    scope = {"hvd": hvd, "hvd_aps": hvd_aps, "keras": keras, "model": model, "x": x, "y": y}
    exec(code["keras"], scope)
    out["keras_weights"], out["keras_before"] = flat(model.trainable_variables), before
    out["controller_mpi"] = np.array(hvd.mpi_enabled())
    return hvd.rank()


def torchrun(code: dict, out: dict) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import hvd_aps
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = torch_model()
    ddp_model = DistributedDataParallel(model)
    exec(code["ddp"], {"hvd_aps": hvd_aps, "ddp_model": ddp_model})
    out["ddp_grads"], out["ddp_own"] = torch_step(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1), rank)

    model = torch_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    exec(code["fsdp"], {"hvd_aps": hvd_aps, "model": model})
    out["fsdp_grads"], out["fsdp_own"] = torch_step(model, torch.optim.SGD(model.parameters(), lr=0.1), rank)
    dist.destroy_process_group()
    return rank


LAUNCHES = {"horovod-torch": horovod_torch, "horovod-tensorflow": horovod_tensorflow, "torchrun": torchrun}

if __name__ == "__main__":
    launch, outdir = sys.argv[1], pathlib.Path(sys.argv[2])
    results = {}
    rank = LAUNCHES[launch](blocks(), results)
    np.savez(outdir / f"readme_{launch}_rank{rank}.npz", **results)
