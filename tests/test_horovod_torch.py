"""APSCompressor through horovod.torch's own API under real `horovodrun --gloo`
processes, 2 and 3 ranks: codes on the wire by default, float16 values with wire="values"."""
import ml_dtypes
import numpy as np
import pytest

import model
from horovod_run import horovodrun, load
from workers.common import (CODES_SIZES, check_slow_rank_runs, codes_grads, format_mismatch, poisoned, rank_data,
                            spiked)


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"torch{request.param}")
    horovodrun("torch_checks.py", tmp, ranks=request.param)
    return load(tmp, f"torch{request.param}", request.param)


def identical(ranks, key):
    return all(r[key].tobytes() == ranks[0][key].tobytes() for r in ranks)


def test_allreduce_sends_codes_bit_exact_to_the_numpy_model(ranks):
    n = len(ranks)
    want_avg = model.flat([[rank_data(r)] for r in range(n)], "e4m3")[0]
    want_sum = model.flat([[rank_data(r, sigma=3.0, seed=1)] for r in range(n)], "e5m2", average=False)[0]
    for r in ranks:
        assert r["avg"].tobytes() == want_avg.tobytes()
        assert r["sum_e5m2"].tobytes() == want_sum.tobytes()
        assert r["after"].tobytes() == want_avg.tobytes()  # nothing carried over from the NaN/Inf calls
    # a ring allreduce of 1-byte codes, plus the re-encode exponents: avg, zeros and after (the
    # NaN tensor sends no codes); a tensor of one block has one owner, so the ranks' shares differ
    ring = 2 * (n - 1) / n * (1000 + 100 + 1000)
    assert ring <= np.mean([int(r["bytes_sent"]) for r in ranks]) <= ring * 1.02 + 64


def test_an_average_learned_from_the_step_before_is_divided_at_decode(ranks):
    """The second Average is averaged by the exchange (learned from the first), with the bits of
    dividing after; a Sum then raises on every rank, and the next Sum and Average are exact."""
    n = len(ranks)
    data = [[rank_data(r)] for r in range(n)]
    want_avg, want_sum = model.flat(data, "e4m3")[0], model.flat(data, "e4m3", average=False)[0]
    for r in ranks:
        for step in range(3):
            assert r[f"switch_avg_{step}"].tobytes() == want_avg.tobytes(), step
        assert "Use one APSCompressor for each reduction" in str(r["switch_error"])
        assert r["switch_sum"].tobytes() == want_sum.tobytes()


def test_error_feedback_through_horovods_optimizer_is_bit_exact(ranks):
    steps = [[[rank_data(r, seed=step)] for r in range(len(ranks))] for step in range(3)]
    for step, want in enumerate(model.with_error_feedback(steps, "e2m1fn")):
        for r in ranks:
            assert r[f"ef_{step}"].tobytes() == want[0].tobytes(), step


def test_hybrid_precision_through_horovods_allreduce_is_bit_exact(ranks):
    """A grouped allreduce of a Gaussian tensor and one whose outlier (on rank 1 only) makes e2m1fn
    flush the rest: the first in e2m1fn, the second in e4m3 on every rank, each lane bit-exact."""
    n = len(ranks)
    narrow = model.flat([[rank_data(r, seed=4)] for r in range(n)], "e2m1fn")[0]
    wide = model.flat([[spiked(r)[:999]] for r in range(n)], "e4m3")[0]
    for r in ranks:
        assert r["hybrid"].tobytes() == np.concatenate([narrow, wide]).tobytes()
        assert sorted(r["hybrid_formats"]) == ["e2m1fn", "e4m3"]


def test_chunks_pipelined_on_horovods_async_collectives_are_bit_exact(ranks):
    """Chunks of 300 elements change the collectives, not the numbers."""
    want = model.flat([[rank_data(r, seed=6)] for r in range(len(ranks))], "e4m3")[0]
    for r in ranks:
        assert r["chunked"].tobytes() == want.tobytes()


def test_naive_cast_loses_small_gradients_and_aps_keeps_them(ranks):
    exact = np.mean([rank_data(r).astype(np.float64) for r in range(len(ranks))], axis=0)
    assert np.linalg.norm(ranks[0]["avg"] - exact) / np.linalg.norm(exact) < 0.05
    assert (ranks[0]["naive"] == 0).all()  # sigma 1e-4 is below e4m3's smallest subnormal


def test_zeros_and_non_finite_on_one_rank_show_on_all(ranks):
    for r in ranks:
        assert (r["zeros"] == 0).all()
        assert np.isnan(r["nan"]).all() and np.isnan(r["inf"]).all()


def test_dtypes_pass_through(ranks):
    n = len(ranks)
    assert bool(ranks[0]["bf16_dtype_ok"])
    # bfloat16 under min_elements (Horovod's Gloo allreduce refuses bfloat16): the average of the
    # bfloat16 inputs to bfloat16's precision (Horovod scales by 1/N in float32), alike on every rank
    mean = np.mean([r["bf16_small_in"].astype(np.float64) for r in ranks], axis=0)
    want = mean.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    for r in ranks:
        assert np.allclose(r["bf16_small"], want, rtol=2 ** -8, atol=0)
        assert r["bf16_small"].tobytes() == ranks[0]["bf16_small"].tobytes()
    assert ranks[0]["ints"].tolist() == [k * n * (n + 1) // 2 for k in range(5)]  # integers are not compressed


@pytest.mark.parametrize("key, average", [("step_avg", True), ("step_predivide", True), ("step_sum_groups", False)])
def test_optimizer_step_is_bit_exact_to_the_numpy_model(ranks, key, average):
    """horovod.torch.DistributedOptimizer: Average, Average with gradient_predivide_factor (Horovod's
    pre/postscale, read back from the token) and Sum with groups."""
    grads = [codes_grads(r) for r in range(len(ranks))]
    for i, shape in enumerate(CODES_SIZES):
        if np.prod(shape) < 16:  # Horovod's plain allreduce
            exact = np.sum([g[i].astype(np.float64) for g in grads], axis=0) / (len(ranks) if average else 1)
            assert np.allclose(ranks[0][f"{key}_{i}"], exact, rtol=1e-6, atol=0)
            continue
        want = model.flat([[g[i].ravel()] for g in grads], "e4m3", average)[0].reshape(shape)
        for r in ranks:
            assert r[f"{key}_{i}"].tobytes() == want.tobytes(), (key, i)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_optimizer_step_of_a_low_precision_model(ranks, dtype):
    """A model held in bfloat16 or float16 through horovod.torch.DistributedOptimizer (Horovod
    alone refuses bfloat16 on Gloo): gradients come back in their dtype, codes bit-exact to the
    model of their values rounded back to it; tensors too small for codes through Horovod's own
    allreduce in float32 within the dtype's roundings of the float64 average."""
    grads = [[model.held_in(g, dtype) for g in codes_grads(r)] for r in range(len(ranks))]
    want = {i: model.flat([[g[i].ravel()] for g in grads], "e4m3")[0] for i, s in enumerate(CODES_SIZES)
            if np.prod(s) >= 16}  # every tensor its own batch
    assert model.low_precision_mismatches(ranks, f"step_{dtype}", grads, want, dtype, CODES_SIZES) == []


@pytest.mark.parametrize("key", ["params_avg", "params_sum_groups", "params_bpps_predivide"])
def test_training_leaves_parameters_bit_identical(ranks, key):
    assert identical(ranks, key) and np.isfinite(ranks[0][key]).all()


def test_values_wire_is_the_float16_carrier(ranks):
    n = len(ranks)
    want, s = model.stock_reference([rank_data(r) for r in range(n)], ml_dtypes.float8_e4m3, "e4m3")
    assert identical(ranks, "values_avg") and int(ranks[0]["values_avg_shift"]) == s
    # Gloo adds 2 ranks' float16 values in rank order; with 3 its ring order is its own
    assert ranks[0]["values_avg"].tobytes() == want.tobytes() if n == 2 else np.allclose(ranks[0]["values_avg"], want, rtol=2e-3)
    for r in ranks:
        # a tensor with NaN/Inf goes unscaled in float16: its finite entries keep float16 accuracy
        assert not np.isfinite(r["values_nan"][3])
        exact = np.mean([poisoned(k, 0.0).astype(np.float64) for k in range(n)], axis=0)
        assert np.allclose(np.delete(r["values_nan"], 3), np.delete(exact, 3), rtol=0, atol=2 ** -21)


def test_mismatches_fail_on_every_rank_naming_the_tensor(ranks):
    for r in ranks:
        assert str(r["mismatch"]) == f"ValueError: {format_mismatch(len(ranks))}"
        # named (a grouped allreduce's name and position): the ranks' layouts disagree on the first
        assert "ValueError: ranks handed different gradients to the exchange: order.0 (float32[5000]) has 5000 " \
               "elements on rank 0 and 7000 on rank" in str(r["order"])
    assert identical(ranks, "after_errors")


def test_a_step_that_raises_leaves_the_compressor_as_it_was(ranks):
    """Error feedback on: good step, a step that raises on every rank, two good steps: the results
    equal the model of the good steps alone, under the same batch names, in the same buffers."""
    n = len(ranks)
    steps = [[[rank_data(r, seed=20 + s), rank_data(r, seed=30 + s)[:700]] for r in range(n)] for s in range(3)]
    # one batch, in the order Horovod's grouped allreduce compresses them
    want = model.with_error_feedback(steps, "e2m1fn")
    for r in ranks:
        assert "ranks handed different tensors" in str(r["recovery_error"])
        assert bool(r["recovery_names_restart"])
        for s in range(3):
            for t in range(2):
                assert r[f"recovery_{s}_{t}"].tobytes() == want[s][t].tobytes(), (s, t)


def test_stochastic_rounding_gives_the_same_bits_on_every_run(ranks):
    for r in ranks:
        runs = r["stochastic_runs"]
        assert all(run.tobytes() == runs[0].tobytes() for run in runs[1:])
    assert identical(ranks, "stochastic_runs")


def test_policy_auto_passes_decided_batches_to_horovods_own_allreduce(ranks):
    for r in ranks:
        for fallback in ("float32", "float16"):
            assert r[f"native_{fallback}"].tobytes() == r[f"stock_{fallback}"].tobytes(), fallback
            # counted as every native exchange: the ring's bytes of the fallback dtype, the tensor as carried in it
            itemsize, n = np.dtype(fallback).itemsize, len(ranks)
            assert int(r[f"native_{fallback}_bytes"]) == int(2 * (n - 1) / n * itemsize * 1000)
            assert str(r[f"native_{fallback}_carried"]) == fallback
        assert str(r["auto_decision"]) in ("codes", "native float32")
        assert bool(r["bfloat16_refused"])
    assert identical(ranks, "auto_decision")


def test_a_slow_rank_through_horovods_optimizer_neither_hangs_nor_flaps(tmp_path):
    """The one line with policy="auto" while the last rank's backward sleeps
    (workers/slow_rank_checks.py): the same decisions on every rank after every step, none
    changes once decided (the re-check, RECHECK_STEPS later, lies past the run), and the step
    follows the slow rank."""
    horovodrun("slow_rank_checks.py", tmp_path, args=("horovod",))
    check_slow_rank_runs(load(tmp_path, "slow"))
