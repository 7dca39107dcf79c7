"""hvd_aps.ddp.aps_hook in DistributedDataParallel under real `torchrun` processes (Gloo on
loopback), 2 and 3 ranks, against the NumPy + ml_dtypes model of the exchange."""
import os
import subprocess
import sys

import numpy as np
import pytest

from horovod_run import WORKERS, load
from test_wire import reference, reference_in_chunks
from workers.common import DDP_SIZES, codes_grads


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"ddp{request.param}")
    env = dict(os.environ, PYTHONPATH=str(WORKERS), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(request.param),
           "--master-addr", "127.0.0.1", "--master-port", str(29400 + request.param),
           str(WORKERS / "ddp_checks.py"), str(tmp)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-4000:]}"
    return load(tmp, f"ddp{request.param}", request.param)


def expected(rank_grads, order, average=True, chunk=None):
    """Every bucket's tensors, in the order the hook saw them, through the model of the exchange
    (cut into chunks of `chunk` elements where given)."""
    want = {}
    for bucket in order.split(";"):
        idx = [int(i) for i in bucket.split(",")]
        grads = [[g[i].ravel() for i in idx] for g in rank_grads]
        model = reference(grads, "e4m3", average) if chunk is None else reference_in_chunks(grads, "e4m3", chunk)
        for i, w in zip(idx, model):
            want[i] = w.reshape(DDP_SIZES[i])
    return want


@pytest.mark.parametrize("key, steps", [("plain", 2), ("view", 1), ("group", 1), ("chunked", 1)])
def test_bit_exact_to_the_numpy_model_on_every_rank(ranks, key, steps):
    """Several buckets; two steps, so the buckets DDP rebuilds after the first step are covered;
    gradient_as_bucket_view; a process group other than the default; chunks of 700 elements."""
    grads = [codes_grads(r, DDP_SIZES) for r in range(len(ranks))]
    for step in range(steps):
        order = ranks[0][f"{key}_{step}_order"].item()
        want = expected(grads, order, chunk=700 if key == "chunked" else None)
        for r in ranks:
            assert r[f"{key}_{step}_order"].item() == order
            for i in range(len(DDP_SIZES)):
                assert r[f"{key}_{step}_{i}"].tobytes() == want[i].tobytes(), (key, step, i)
    if key == "plain":  # DDP's buckets before and after its rebuild differ; one step has several
        orders = [ranks[0][f"plain_{step}_order"].item() for step in range(steps)]
        assert orders[0] != orders[1] and any(";" in order for order in orders)


def test_bytes_of_a_ring_of_one_byte_codes(ranks):
    n, elements = len(ranks), sum(int(np.prod(s)) for s in DDP_SIZES)
    ring = 2 * (n - 1) / n * elements * 2  # two steps of 1-byte codes
    assert all(ring <= int(r["plain_bytes"]) <= ring * 1.03 + 256 for r in ranks)


def test_half_buckets_come_back_in_their_dtype(ranks):
    grads = [[g.astype(np.float16).astype(np.float32) for g in codes_grads(r, DDP_SIZES)] for r in range(len(ranks))]
    want = expected(grads, ranks[0]["half_0_order"].item())
    for r in ranks:
        assert bool(r["half_0_dtype_ok"])
        for i in range(len(DDP_SIZES)):
            assert r[f"half_0_{i}"].tobytes() == want[i].astype(np.float16).astype(np.float32).tobytes()


def test_zeros_and_nan_on_one_rank_show_on_all(ranks):
    for r in ranks:
        assert (r["poisoned_0_0"] == 0).all() and np.isnan(r["poisoned_0_1"]).all()
        assert np.isfinite(r["poisoned_0_4"]).all()


def test_no_sync_exchanges_the_accumulated_sum(ranks):
    n = len(ranks)
    summed = [[a + b for a, b in zip(codes_grads(r, DDP_SIZES), codes_grads(r + 10, DDP_SIZES))] for r in range(n)]
    want = expected(summed, ranks[0]["no_sync_order"].item())
    for r in ranks:
        assert int(r["no_sync_calls_during_no_sync"]) == 0
        for i in range(len(DDP_SIZES)):
            assert r[f"no_sync_{i}"].tobytes() == want[i].tobytes(), i


@pytest.mark.parametrize("key", ["train_unused", "train_static"])
def test_training_leaves_parameters_identical(ranks, key):
    for r in ranks:
        assert r[key].tobytes() == ranks[0][key].tobytes() and np.isfinite(r[key]).all()
    if key == "train_unused":
        assert int(ranks[0]["train_unused_buckets"]) >= 4
