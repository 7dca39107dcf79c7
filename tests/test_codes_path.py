"""hvd_aps.torch.DistributedOptimizer under real `horovodrun --gloo` processes: 2 ranks, and 3,
where shards do not divide evenly; Horovod's optimizer lifecycle."""
import numpy as np
import pytest

import model
from horovod_run import horovodrun, load
from support import BIG
from workers.common import CODES_SIZES, codes_grads


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"codes{request.param}")
    horovodrun("codes_checks.py", tmp, ranks=request.param)
    return load(tmp, f"codes{request.param}", request.param)




@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn"])
def test_equal_to_the_numpy_model_on_every_rank(ranks, fmt):
    """Tensors of >= 16 elements travel as codes in one bucket, in reverse order: bit for bit as
    the NumPy + ml_dtypes model. Smaller ones take Horovod's own float32 average."""
    grads = [codes_grads(r) for r in range(len(ranks))]
    want = dict(zip(BIG[::-1], model.flat([[g[i].ravel() for i in BIG[::-1]] for g in grads], fmt)))
    for r in ranks:
        for i in BIG:
            assert r[f"{fmt}_{i}"].tobytes() == want[i].reshape(CODES_SIZES[i]).tobytes(), (fmt, i)
        for i in set(range(len(CODES_SIZES))) - set(BIG):
            exact = np.mean([g[i].astype(np.float64) for g in grads], axis=0)
            assert np.allclose(r[f"{fmt}_{i}"], exact, rtol=1e-6, atol=0) and r[f"{fmt}_{i}"].shape == CODES_SIZES[i]
        assert all(r[f"{fmt}_{i}"].tobytes() == ranks[0][f"{fmt}_{i}"].tobytes() for i in range(len(CODES_SIZES)))


def test_the_native_path_is_horovods_float32_sum_averaged_and_counted(ranks):
    """policy="auto" settled on Horovod's float32 allreduce: each gradient summed by Horovod and
    divided by the ranks in float32 (2 ranks: the exact float32 average, bit for bit), alike on
    every rank, its bytes a float32 ring's: twice the float16 path's for the bucketed tensors;
    in place as Horovod's own optimizer sends it, not through the compressor's threads (the
    float16 path's cast bucket is)."""
    assert ranks[0]["native_float32_threaded"] == 0 and ranks[0]["native_float16_threaded"] == 1
    grads = [codes_grads(r) for r in range(len(ranks))]
    for i in range(len(CODES_SIZES)):
        got = ranks[0][f"native_float32_{i}"]
        if len(ranks) == 2:
            assert got.tobytes() == ((grads[0][i] + grads[1][i]) / np.float32(2)).tobytes(), i
        parts = np.array([g[i] for g in grads], np.float64)
        bound = 2 * len(ranks) * np.finfo(np.float32).eps * np.abs(parts).mean(axis=0)  # float32 sums' rounding
        assert (np.abs(got - parts.mean(axis=0)) <= bound).all(), i
        assert all(r[f"native_float32_{i}"].tobytes() == got.tobytes() for r in ranks), i
    n, big = len(ranks), sum(int(np.prod(CODES_SIZES[i])) for i in BIG)
    ring = 2 * (n - 1) / n * big  # a ring allreduce's elements a rank sends
    assert ranks[0]["native_float32_bytes"] - ranks[0]["native_float16_bytes"] == pytest.approx(ring * (4 - 2), abs=8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_model_gets_its_dtype_back(ranks, dtype):
    """Parameters held in bfloat16 or float16: the bucket's codes from the gradients' values
    (exact in float32), each result rounded back to the dtype, bit for bit as the model; tensors
    too small for codes through Horovod's allreduce (bfloat16, which Horovod's Gloo refuses, as
    float32) within the dtype's roundings of the float64 average."""
    n = len(ranks)
    grads = [[model.held_in(g, dtype) for g in codes_grads(r)] for r in range(n)]
    want = dict(zip(BIG[::-1], model.flat([[g[i].ravel() for i in BIG[::-1]] for g in grads], "e4m3")))
    assert model.low_precision_mismatches(ranks, dtype, grads, want, dtype, CODES_SIZES) == []


def test_bytes_sent_per_rank(ranks):
    world = len(ranks)
    elements = sum(int(np.prod(s)) for s in CODES_SIZES if np.prod(s) >= 16)
    for fmt, per_element in (("e4m3", 1.0), ("e2m1fn", 0.5)):
        ring = 2 * (world - 1) / world * elements * per_element
        mean = np.mean([int(r[f"{fmt}_bytes"]) for r in ranks])  # blocks have one owner each: shares differ
        assert ring <= mean <= ring * 1.02 + 64


def test_zeros_and_non_finite(ranks):
    for r in ranks:
        assert np.isnan(r["poisoned_0"]).all()  # the Inf on one rank shows on every rank
        assert (r["poisoned_1"] == 0).all()
        for i in range(2, len(CODES_SIZES)):
            assert np.isfinite(r[f"poisoned_{i}"]).all()


def test_training_is_identical_on_every_rank(ranks):
    for r in ranks[1:]:
        assert r["params"].tobytes() == ranks[0]["params"].tobytes()
    assert all(bool(r["unused_unchanged"]) for r in ranks)
    assert int(ranks[0]["buckets"]) > 1


def test_horovod_lifecycle(ranks):
    for r in ranks:
        for key in ("zero_grad_refused", "skip_sent_nothing", "plain_step_warned", "compression_required",
                    "bfloat16_fallback_refused"):
            assert bool(r[key]), key
        assert r["lifecycle_params"].tobytes() == ranks[0]["lifecycle_params"].tobytes()
        shared = "this APSCompressor already serves an hvd_aps.torch.DistributedOptimizer"
        assert str(r["shared_refused"]).startswith(shared)


def test_a_synchronize_that_raises_leaves_optimizer_and_compressor_as_they_were(ranks):
    for r in ranks:
        assert "injected failure of bucket 1" in str(r["optimizer_error"])
        assert bool(r["optimizer_recovered"]) and bool(r["optimizer_buffers_kept"])
        assert r["optimizer_params"].tobytes() == ranks[0]["optimizer_params"].tobytes()
