"""hvd_aps.ddp.aps_hook in DistributedDataParallel under real `torchrun` processes (Gloo on
loopback), 2 and 3 ranks, against the NumPy + ml_dtypes model of the exchange."""
import numpy as np
import pytest

import model
from support import assert_bit_exact, assert_low_precision, expected, launch_ddp_checks
from workers.common import DDP_SIZES, check_slow_rank_runs, codes_grads, format_mismatch


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    return launch_ddp_checks(tmp_path_factory.mktemp(f"ddp{request.param}"), request.param)


@pytest.mark.parametrize("key, steps", [("plain", 2), ("view", 1), ("group", 1), ("chunked", 1)])
def test_bit_exact_to_the_numpy_model_on_every_rank(ranks, key, steps):
    """Several buckets; two steps, so the buckets DDP rebuilds after the first step are covered;
    gradient_as_bucket_view; a process group other than the default; chunks of 700 elements (the
    same numbers: chunking is scheduling)."""
    assert_bit_exact(ranks, key, steps)
    if key == "plain":  # DDP's buckets before and after its rebuild differ; one step has several
        orders = [ranks[0][f"plain_{step}_order"].item() for step in range(steps)]
        assert orders[0] != orders[1] and any(";" in order for order in orders)


def test_bytes_of_a_ring_of_one_byte_codes(ranks):
    n, elements = len(ranks), sum(int(np.prod(s)) for s in DDP_SIZES)
    ring = 2 * (n - 1) / n * elements * 2  # two steps of 1-byte codes
    # owners' ranges end on block boundaries and torch's all_gather takes equal sizes: each of the
    # three exchanges (one bucket, then two) pads every owner's message to the longest, a block at most
    mean = np.mean([int(r["plain_bytes"]) for r in ranks])
    assert ring <= mean <= ring + 3 * (n - 1) * (model.BLOCK + 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_buckets_come_back_in_their_dtype(ranks, dtype):
    """A model held in float16 or bfloat16: codes from the gradients' values (exact in float32),
    the results rounded back to the bucket's dtype, bit for bit as the model."""
    assert_low_precision(ranks, dtype)


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


def test_stochastic_rounding_gives_the_same_bits_on_every_run(ranks):
    for r in ranks:
        runs = r["stochastic_runs"]
        assert all(run.tobytes() == runs[0].tobytes() for run in runs[1:])
        assert runs[0].tobytes() == ranks[0]["stochastic_runs"][0].tobytes()


def test_a_step_that_raises_leaves_the_state_as_it_was(ranks):
    for r in ranks:
        assert "injected failure of bucket 0" in str(r["ddp_error"])
        assert bool(r["ddp_recovered"])


def test_policy_auto_native_buckets_take_torchs_own_allreduce_hook(ranks):
    world, elements = len(ranks), sum(int(np.prod(shape)) for shape in DDP_SIZES)
    for r in ranks:
        assert bool(r["native_equals_default"])
        assert int(r["native_bytes"]) == int(2 * (world - 1) / world * 4 * elements)
        assert list(r["native_formats"]) == ["float32"] and int(r["native_elements"]) == elements


def test_settings_that_differ_between_ranks_are_refused_at_the_state_on_every_rank(ranks):
    for r in ranks:
        assert str(r["mismatch"]) == format_mismatch(len(ranks))


def test_a_compressor_given_to_a_second_state_is_refused_on_every_rank(ranks):
    for r in ranks:
        assert str(r["shared_refused"]).startswith("this APSCompressor already serves an hvd_aps.ddp.APSState")


def test_a_slow_rank_neither_hangs_nor_splits_or_flaps_the_schedules_decisions(tmp_path):
    """The last rank's backward sleeps (workers/slow_rank_checks.py): the step follows it, every
    rank holds the same decisions after every step, and once policy="auto" has decided, no
    decision changes in a later step."""
    check_slow_rank_runs(launch_ddp_checks(tmp_path, 2, script="slow_rank_checks.py", prefix="slow"))


def test_policy_auto_times_every_path_again_on_every_rank_when_kept_codes_drift(tmp_path):
    """Codes kept, then their steps slow down on one rank (workers/drift_checks.py): every rank
    starts the trials again at the same step, a window after the settled one, and keeps codes
    again (the framework's allreduce stays the slower), on the same parameters."""
    import json
    from hvd_aps._schedule import DRIFT_WINDOW
    ranks = launch_ddp_checks(tmp_path, 2, script="drift_checks.py", prefix="drift")
    steps = [list(r["decisions"]) for r in ranks]
    assert steps[0] == steps[1]
    policies = [json.loads(d)["policy"] for d in steps[0]]
    decided = policies.index("codes")
    again = policies.index(None, decided)  # ValueError: never timed again
    assert decided + 2 * DRIFT_WINDOW <= again <= decided + 3 * DRIFT_WINDOW and policies[-1] == "codes"
    np.testing.assert_array_equal(ranks[0]["params"], ranks[1]["params"])
