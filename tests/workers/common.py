"""Inputs shared by the Horovod worker scripts and the tests that check their outputs."""
import os

import numpy as np

SIZE = 1000


def rank_data(rank, sigma=1e-4, seed=0):
    """Rank-specific gradients: Gaussian(0, sigma), different on every rank."""
    return np.random.default_rng(1000 * seed + rank).normal(0, sigma, SIZE).astype(np.float32)


def poisoned(rank, bad):
    x = rank_data(rank, seed=7)
    if rank == 1:
        x[3] = bad
    return x


def spiked(rank, seed=5):
    """Rank data with one entry 10**4 times the largest on rank 1 only: a 4-bit format flushes
    the rest of the tensor, so hybrid precision must send it wide on every rank."""
    x = rank_data(rank, seed=seed)
    if rank == 1:
        x[3] = 1e4 * np.abs(x).max()
    return x


def keras_data(rank, batch=16):
    rng = np.random.default_rng(50 + rank)
    x = rng.normal(size=(batch, 4)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.25).astype(np.float32)


KERAS_W0 = np.array([[0.1], [0.2], [-0.3], [0.4]], np.float32)
KERAS_LR = 0.1

CODES_SIZES = [(50, 7), (3001,), (16,), (5,), (0,), (1000,)]
DDP_SIZES = [(50, 7), (3001,), (16,), (5,), (1000,)]  # DDP has no empty parameters


def codes_grads(rank, sizes=CODES_SIZES):
    """Tensors for the codes path: uneven sizes, a tiny one, an empty one, wide magnitudes."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 1)).astype(np.float32) for s in sizes]


def leave_torchrun():
    """End a torchrun worker once it has saved its results: a barrier (every rank has saved),
    then exit without tearing Gloo down. Torch's Gloo can abort a process in interpreter teardown
    ("terminate called without an active exception": a worker thread dropping a tensor whose
    deleter needs the GIL during finalisation, pytorch/pytorch#179291), and a worker aborting after
    its results are written would fail a test about those results."""
    import torch.distributed as dist
    dist.barrier()
    os._exit(0)
