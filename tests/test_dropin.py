"""APSCompressor as a drop-in for Horovod's Compression under real `horovodrun --gloo` processes:
every scenario runs with Compression.none and with codes, and both must train alike (the same
parameters on every rank, within the codes' error of the stock run) or both raise."""
import numpy as np
import pytest

import model
from horovod_run import horovodrun, load
from test_ddp import launch_ddp_checks

# e4m3 keeps 3 bits of mantissa: three SGD steps at lr 0.1 move parameters of this model by at
# most about 0.1, and the codes' relative error of about 2^-4 on each step's gradient stays well
# under this
TOLERANCE = 2e-3
SCENARIOS = ["unused", "alone", "disjoint", "pair", "shifted", "zero_filled"]


def assert_trained_alike(saved: dict, scenario: str) -> None:
    """A rank's stock and codes runs of `scenario` both trained (no error), to within the codes'
    error of each other."""
    errors = {run: str(saved.get(f"{scenario}_{run}_error", "")) for run in ("stock", "codes")}
    assert errors == {"stock": "", "codes": ""}, errors
    stock, codes = saved[f"{scenario}_stock"], saved[f"{scenario}_codes"]
    assert np.abs(codes - stock).max() <= TOLERANCE * max(1.0, np.abs(stock).max()), scenario


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropin")
    horovodrun("dropin_checks.py", tmp, ranks=3, timeout=300)
    return load(tmp, "dropin", 3)


def test_an_allreduce_on_a_process_set_is_the_exchange_of_its_ranks_alone(ranks):
    """Bit for bit the NumPy model of the codes exchange among the set's ranks only."""
    data = [np.random.default_rng(r).normal(size=5000).astype(np.float32) for r in range(3)]
    for members, scenario in (([0, 1], "allreduce_pair"), ([0], "allreduce_alone")):
        want = model.flat([[data[m]] for m in members], "e4m3")[0]
        for m in members:
            assert ranks[m][f"{scenario}_codes"].tobytes() == want.tobytes(), (scenario, m)
        assert np.allclose(ranks[members[0]][f"{scenario}_stock"], np.mean([data[m] for m in members], axis=0))


def test_a_second_horovod_optimizer_is_refused_on_every_rank(ranks):
    for r in ranks:
        assert "first_owner" in r and str(r["second_owner_error"]).startswith(
            "ValueError: this APSCompressor already serves Horovod's DistributedOptimizer over SGD")


def test_settings_that_cut_other_buckets_are_named_on_every_rank(ranks):
    for r in ranks:
        assert str(r["bucket_bytes_differ_error"]).startswith(
            "ValueError: APSCompressor settings differ between ranks: bucket_bytes: 4096 on rank 0, 8192 on rank 1, "
            "12288 on rank 2"), str(r["bucket_bytes_differ_error"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_codes_train_as_horovods_own_allreduce(ranks, scenario):
    for r in ranks:
        assert_trained_alike(r, scenario)


@pytest.mark.parametrize("scenario, members", [("unused", [0, 1, 2]), ("pair", [0, 1]), ("allreduce_pair", [0, 1]),
                                               ("shifted", [1, 2]), ("zero_filled", [0, 1, 2])])
def test_every_rank_of_a_set_ends_with_the_same_parameters(ranks, scenario, members):
    members = [ranks[m] for m in members]
    assert all(r[f"{scenario}_codes"].tobytes() == members[0][f"{scenario}_codes"].tobytes() for r in members)


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    return launch_ddp_checks(tmp_path_factory.mktemp("ddpdropin"), 2, "ddp_dropin_checks.py", "ddpdropin")


@pytest.mark.parametrize("scenario", ["ddp_unused", "ddp_static", "ddp_view", "ddp_join"])
def test_ddp_with_codes_trains_as_ddp_alone(ddp_ranks, scenario):
    """find_unused_parameters with a head one rank uses, static_graph, gradient_as_bucket_view,
    and join() with one batch fewer on rank 1."""
    for r in ddp_ranks:
        assert_trained_alike(r, scenario)
    if scenario != "ddp_join":  # the rank that joined early took one step fewer
        assert ddp_ranks[0][f"{scenario}_codes"].tobytes() == ddp_ranks[1][f"{scenario}_codes"].tobytes()


@pytest.fixture(scope="module")
def tf_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tfdropin")
    horovodrun("tf_dropin_checks.py", tmp, ranks=3, timeout=300)
    return load(tmp, "tfdropin", 3)


@pytest.mark.parametrize("scenario, members", [("tf_none", [0, 1, 2]), ("tf_pair", [0, 1])])
def test_tensorflows_tape_with_codes_trains_as_with_horovods_own(tf_ranks, scenario, members):
    """A variable no rank uses (its gradient None everywhere), and the tape on a process set
    without the last rank (found in AutoGraph's conversion of Horovod's function)."""
    members = [tf_ranks[m] for m in members]
    for r in members:
        assert_trained_alike(r, scenario)
    assert all(r[f"{scenario}_codes"].tobytes() == members[0][f"{scenario}_codes"].tobytes() for r in members)
