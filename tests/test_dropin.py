"""APSCompressor as a drop-in for Horovod's Compression under real `horovodrun --gloo` processes:
every scenario runs with Compression.none and with codes, and both must train alike (the same
parameters on every rank, within the codes' error of the stock run) or both raise. Ranks that
disagree raise within APSCompressor(timeout=...) instead of waiting for ever."""
import threading
import time
import types

import numpy as np
import pytest

import model
from horovod_run import horovodrun, load, worker_env
from support import launch_ddp_checks
from workers.common import DISAGREE_TIMEOUT, KERAS_FEATURES, KERAS_HIDDEN, KERAS_VOCAB, KERAS_WIDTH

# e4m3 keeps 3 bits of mantissa: three SGD steps at lr 0.1 move parameters of this model by at
# most about 0.1, and the codes' relative error of about 2^-4 on each step's gradient stays well
# under this
TOLERANCE = 2e-3
GLOO_S = "120"  # Horovod's Gloo timeout a transfer for the 3-rank job (its default: 30 s)
# Horovod's optimizer's options and lifecycle, on the global set: num_groups, synchronize() then
# clipping then step() in skip_synchronize(), backward_passes_per_step=2, an nn.Embedding's sparse
# gradient with and without sparse_as_dense, training after hvd.shutdown() and hvd.init()
OPTIONS = ["num_groups", "clipped", "accumulated", "sparse", "sparse_as_dense", "reinit"]
SCENARIOS = ["unused", "alone", "disjoint", "pair", "shifted", "zero_filled"] + OPTIONS
# seconds past DISAGREE_TIMEOUT a rank may take to raise: its first step's work before the wait,
# on a loaded machine (without the bound it waits for ever)
MARGIN = 20.0


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
    # three ranks on a 2-core machine under load: Gloo's 30 s a transfer ended the job once (a
    # pair timed out while its peer waited for the cores); the job's own bound stays 300 s
    horovodrun("dropin_checks.py", tmp, ranks=3, timeout=300, env=worker_env(HOROVOD_GLOO_TIMEOUT_SECONDS=GLOO_S))
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
                                               ("shifted", [1, 2]), ("zero_filled", [0, 1, 2])]
                         + [(option, [0, 1, 2]) for option in OPTIONS])
def test_every_rank_of_a_set_ends_with_the_same_parameters(ranks, scenario, members):
    members = [ranks[m] for m in members]
    assert all(r[f"{scenario}_codes"].tobytes() == members[0][f"{scenario}_codes"].tobytes() for r in members)


def test_ranks_that_disagree_raise_within_the_timeout_naming_the_collective_and_set(ranks):
    """Rank 1 builds a model with one layer more, whose gradient the others lack: the ranks that
    wait in hvd_aps's agreement of the buckets raise TimeoutError once APSCompressor(timeout=...)
    has passed, naming the allgather and the process set; rank 1 waits in Horovod's own
    negotiation of that gradient (as with Compression.none, for ever) until their end shuts
    Horovod down. A waiting rank whose deadline falls after another's end may see that shutdown
    first (Horovod's error), but the first to time out names the wait. Then hvd.shutdown() and
    hvd.init(), and training goes on (OPTIONS' reinit)."""
    named = []
    for r, saved in enumerate(ranks):
        seconds, error = float(saved["disagree_codes_seconds"]), str(saved["disagree_codes_error"])
        assert seconds <= DISAGREE_TIMEOUT + MARGIN, (r, seconds)
        if error.startswith("HorovodInternalError: Horovod has been shut down"):
            continue
        assert r != 1, error
        assert seconds >= DISAGREE_TIMEOUT, (r, seconds)
        assert error.startswith(f"TimeoutError: hvd_aps: rank {r} had no answer from the other ranks for "
                                f"{DISAGREE_TIMEOUT:g} s in the allgather hvd_aps.layout.sizes on the global process "
                                "set (ranks [0, 1, 2]): do all ranks run the same model and optimizer"), error
        assert "restart it, or hvd.shutdown() and hvd.init() on every rank" in error
        named.append(r)
    assert named, "no rank timed out"


def test_a_wait_on_horovod_ends_after_the_timeout_and_sleeps_between_polls(monkeypatch):
    """The wait behind every collective of the codes path through horovod.torch, on a handle
    that never completes: TimeoutError naming the collective, the set and this rank once
    `timeout` has passed, after a few hundred polls (sleeps between them), not millions; Horovod's
    HorovodInternalError too, which Horovod elastic resets on."""
    from horovod.common.exceptions import HorovodInternalError
    from hvd_aps.torch import adapter
    polls, raised, timeout = [], [], 0.2
    monkeypatch.setattr(adapter.hvd, "poll", lambda handle: polls.append(handle) is not None)
    monkeypatch.setattr(adapter.hvd, "rank", lambda: 3)
    process_set = types.SimpleNamespace(process_set_id=2, ranks=[1, 3])

    def wait():
        try:
            adapter.wait("handle", "the alltoall hvd_aps.0.codes", process_set, timeout)
        except TimeoutError as err:
            raised.append(err)

    start = time.monotonic()
    waiting = threading.Thread(target=wait, daemon=True)  # a wait without a bound fails here, not hangs
    waiting.start()
    waiting.join(timeout + MARGIN)
    assert raised and str(raised[0]).startswith("hvd_aps: rank 3 had no answer from the other ranks for 0.2 s in "
                                                "the alltoall hvd_aps.0.codes on process set 2 (ranks [1, 3])"), raised
    assert isinstance(raised[0], HorovodInternalError)
    assert timeout <= time.monotonic() - start and len(polls) < 2 * timeout / adapter.POLL_MAX + 20


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    return launch_ddp_checks(tmp_path_factory.mktemp("ddpdropin"), 2, "ddp_dropin_checks.py", "ddpdropin")


@pytest.mark.parametrize("scenario", ["ddp_unused", "ddp_static", "ddp_view", "ddp_join", "ddp_no_sync"])
def test_ddp_with_codes_trains_as_ddp_alone(ddp_ranks, scenario):
    """find_unused_parameters with a head one rank uses, static_graph, gradient_as_bucket_view,
    join() with one batch fewer on rank 1, and no_sync() accumulation (half a batch each)."""
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


# Keras 3 through hvd_aps.keras.DistributedOptimizer and an Embedding through Horovod's tape
# (keras_dropin_checks.py): every run saves its flat weights at several points, the start first.
# e4m3 rounds each step's gradient to 3 bits of mantissa (a relative error up to 2^-4): the codes
# run stays within a tenth of the largest move of any weight in the stock run
KERAS_TOLERANCE = 0.1
TRUNK = slice(0, KERAS_FEATURES * KERAS_HIDDEN + KERAS_HIDDEN)  # the trunk's kernel and bias lead
HEAD = slice(-(KERAS_HIDDEN + 1), None)                        # the one-rank head's kernel and bias end
TABLE = slice(0, KERAS_VOCAB * KERAS_WIDTH)                     # the Embedding's table leads


@pytest.fixture(scope="module")
def keras_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kerasdropin")
    horovodrun("keras_dropin_checks.py", tmp, ranks=2, timeout=240)
    return load(tmp, "kerasdropin", 2)


def keras_trained_alike(ranks, scenario):
    """Both runs of `scenario` trained without error, to the same bits on every rank, the codes
    run within KERAS_TOLERANCE of the stock run at every point saved -> rank 0's (stock, codes)."""
    for r in ranks:
        errors = {run: str(r.get(f"{scenario}_{run}_error", "")) for run in ("stock", "codes")}
        assert errors == {"stock": "", "codes": ""}, errors
        for run in ("stock", "codes"):
            assert r[f"{scenario}_{run}"].tobytes() == ranks[0][f"{scenario}_{run}"].tobytes(), (scenario, run)
    stock, codes = ranks[0][f"{scenario}_stock"], ranks[0][f"{scenario}_codes"]
    moved = np.abs(stock[-1] - stock[0]).max()
    assert np.abs(codes - stock).max() <= KERAS_TOLERANCE * moved, scenario
    return stock, codes


def test_keras_with_a_frozen_layer_trains_as_with_horovods_own(keras_ranks):
    """`trainable = False` before compile: the frozen trunk's weights stay as they were, bit for
    bit, and the layer above it trains."""
    for weights in keras_trained_alike(keras_ranks, "keras_frozen"):
        start, end = weights
        assert start[TRUNK].tobytes() == end[TRUNK].tobytes()
        assert not np.array_equal(start[TRUNK.stop:], end[TRUNK.stop:])


def test_keras_trainable_toggled_between_fits_trains_as_with_horovods_own(keras_ranks):
    """Fit with the trunk frozen, unfreeze it, recompile with a new wrapper (the same compressor),
    fit again: the first fit leaves the trunk as it was, the second trains it."""
    for weights in keras_trained_alike(keras_ranks, "keras_toggled"):
        start, first, second = weights
        assert start[TRUNK].tobytes() == first[TRUNK].tobytes()
        assert not np.array_equal(start[TRUNK.stop:], first[TRUNK.stop:])
        assert not np.array_equal(first[TRUNK], second[TRUNK])


def test_keras_refuses_an_optimizer_reused_after_unfreezing_as_without_codes(keras_ranks):
    """Recompiled with the first fit's optimizer, Keras refuses the unfrozen variables: the same
    error on every rank, with codes as without."""
    for r in keras_ranks:
        for run in ("stock", "codes"):
            error = str(r[f"keras_same_optimizer_{run}_error"])
            assert error.startswith("ValueError: Unknown variable: <Variable path=") and "trunk/kernel" in error, error


def test_keras_head_one_rank_uses_trains_on_every_rank_alike(keras_ranks):
    """A head only rank 1's loss reaches (None gradients on rank 0): rank 0 sends zeros for it,
    with codes as without, and the head trains, the same on both ranks."""
    for start, end in keras_trained_alike(keras_ranks, "keras_one_rank_head"):
        assert not np.array_equal(start[HEAD], end[HEAD])


@pytest.mark.parametrize("scenario", ["keras_embedding", "tape_embedding"])
def test_indexed_slices_go_as_horovods_own_allgather_sends_them(keras_ranks, scenario):
    """An Embedding's IndexedSlices through the Keras wrapper and through Horovod's tape
    (num_groups=1): Horovod allgathers them uncompressed, with codes as without, so the table
    after the first step is the stock run's bit for bit (the dense weights beside it are codes)."""
    stock, codes = keras_trained_alike(keras_ranks, scenario)
    assert codes[1][TABLE].tobytes() == stock[1][TABLE].tobytes()
    assert not np.array_equal(stock[0][TABLE], stock[1][TABLE])
    if scenario.startswith("tape"):
        assert [bool(keras_ranks[0][f"{scenario}_{run}_sparse"]) for run in ("stock", "codes")] == [True, True]


@pytest.mark.parametrize("scenario", ["keras_embedding_dense", "tape_embedding_dense"])
def test_indexed_slices_with_sparse_as_dense_go_as_codes(keras_ranks, scenario):
    """With sparse_as_dense=True the table's gradient is densified and then sent as codes: within
    the codes' error of the stock run, no longer its bits."""
    stock, codes = keras_trained_alike(keras_ranks, scenario)
    assert not np.array_equal(codes[1][TABLE], stock[1][TABLE])
    if scenario.startswith("tape"):
        assert [bool(keras_ranks[0][f"{scenario}_{run}_sparse"]) for run in ("stock", "codes")] == [False, False]
