"""A rank waiting for a tensor its live peer never submits, under horovodrun --gloo with Horovod's
stall check on (HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS set by the
test): Horovod must warn, shut the job down and raise on every rank within the set time.

    horovodrun -np 2 --gloo python stall_checks.py MODE OUTDIR

MODE torch, tensorflow: each rank allreduces a tensor named after itself, which the other never
submits (TensorFlow: in a tf.function, where ops keep their names). MODE one-line: the one line (hvd.DistributedOptimizer with an APSCompressor) on a
model whose second layer only rank 0 builds, for a few steps. Each rank saves
OUTDIR/stall_rank<r>.json: the error it got (its type and message), the seconds from hvd.init()
until it got it (two ranks importing TensorFlow at once on 2 cores is not the stall check's time).
"""
import json
import os
import sys
import time

MODE, OUT = sys.argv[1:3]
RANK = int(os.environ["HOROVOD_RANK"])  # horovodrun's: readable whatever state Horovod is left in
began = [time.monotonic()]  # set again once Horovod is up


def initialized(hvd):
    hvd.init()
    began[0] = time.monotonic()


def run_torch():
    import horovod.torch as hvd
    import torch
    initialized(hvd)
    hvd.allreduce(torch.ones(4), name=f"only on rank {RANK}")


def run_tensorflow():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    initialized(hvd)
    # in a graph, where the op keeps its name (eagerly Horovod matches allreduces by call order)
    tf.function(lambda: hvd.allreduce(tf.ones(4), name=f"only_on_rank_{RANK}"))()


def run_one_line():
    import horovod.torch as hvd
    import torch
    import hvd_aps
    initialized(hvd)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(2 if RANK == 0 else 1)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0))
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()


error = None
try:
    {"torch": run_torch, "tensorflow": run_tensorflow, "one-line": run_one_line}[MODE]()
except Exception as e:  # noqa: BLE001: the error is what the test reads
    error = f"{type(e).__name__}: {e}"
with open(f"{OUT}/stall_rank{RANK}.json", "w") as f:
    json.dump({"error": error, "seconds": time.monotonic() - began[0]}, f)
