"""Checkpoint and resume bit for bit: DDP with hvd_aps.ddp.aps_hook and FSDP2 with hvd_aps.fsdp
(real `torchrun` processes, Gloo on loopback), Horovod's DistributedOptimizer with APSCompressor
and hvd_aps.torch.DistributedOptimizer, TensorFlow's tape and Keras 3's model.fit (`horovodrun -np 2
--gloo`, and 2 hosts x 2 ranks on two levels). Each trains straight, or
half, saves (model, optimizer, compressor), and a fresh process loads and trains the rest. With
error feedback (residuals that DDP's rebuilt buckets and the resumed process's first buckets
lay out differently) and stochastic rounding (seeds from parameter names and steps), the two
runs end on the same bits on every rank. The straight run saves the checkpoint at half its steps
(a run never stopped, checkpointing), and the resumed one is a fresh process that loads it. The
straight runs end on the bits the tree before gave them (tests/data/recorded_bits.py)."""
import os

import numpy as np
import pytest

from horovod_run import horovodrun, load, torchrun
from hosts_run import launch
from data import recorded_bits
from workers.common import RESUME_MODES

RANKS = 2
DDP_SETTINGS = ("feedback", "stochastic", "feedback_one_bucket", "fsdp")
HOROVOD_SETTINGS = ("feedback", "stochastic", "codes_optimizer")
TF_SETTINGS = ("feedback", "stochastic", "keras_feedback", "keras_stochastic")


def ddp_resume(tmp_path, mode):
    torchrun("ddp_resume_checks.py", tmp_path, mode, ranks=RANKS)
    return load(tmp_path, mode, RANKS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    return ddp_resume(tmp, "straight"), ddp_resume(tmp, "second")


@pytest.mark.parametrize("setting", DDP_SETTINGS)
def test_straight_and_resumed_runs_end_on_the_same_bits(runs, setting):
    straight, resumed = runs
    for rank in range(RANKS):
        assert straight[rank][setting].tobytes() == resumed[rank][setting].tobytes(), (setting, rank)
    assert straight[0][setting].tobytes() == straight[1][setting].tobytes()
    assert np.isfinite(straight[0][setting]).all()


def ends_elsewhere_unloaded(straight, resumed, settings):
    """The negative control: resumed without the compressor's state (model and optimizer loaded),
    each of these settings ends on other bits than the run never stopped, on every rank."""
    for rank in range(len(straight)):
        for setting in settings:
            assert resumed[rank][f"{setting}_unloaded"].tobytes() != straight[rank][setting].tobytes(), (setting, rank)


def test_a_resume_without_the_compressors_state_ends_elsewhere(runs):
    ends_elsewhere_unloaded(*runs, ("feedback", "fsdp"))


def horovod_resumed(tmp, worker, prefix, levels):
    """A Horovod worker's straight and resumed runs: horovodrun's 2 ranks on one host
    (levels "flat"), or 2 hosts x 2 ranks (tests/hosts_run.py: float32 inside a host through
    shared memory, codes between hosts)."""
    done = {}
    for mode in RESUME_MODES:
        os.environ["HVD_APS_MODE"] = mode  # the launchers hand their environment to the workers
        try:
            if levels == "flat":
                horovodrun(worker, tmp)
            else:
                launch(worker, tmp)
        finally:
            del os.environ["HVD_APS_MODE"]
        done[mode] = load(tmp, f"{prefix}_{mode}", RANKS if levels == "flat" else 4)
    return done["straight"], done["second"]


@pytest.fixture(scope="module", params=["flat", "two_levels"])
def horovod_runs(tmp_path_factory, request):
    return horovod_resumed(tmp_path_factory.mktemp(f"horovod_resume_{request.param}"), "horovod_resume_checks.py",
                           "hvd", request.param)


@pytest.mark.parametrize("setting", HOROVOD_SETTINGS)
def test_horovod_optimizer_resumes_on_the_same_bits(horovod_runs, setting):
    straight, resumed = horovod_runs
    for rank in range(len(straight)):
        assert straight[rank][setting].tobytes() == resumed[rank][setting].tobytes(), (setting, rank)


def test_horovod_resumed_without_the_compressors_state_ends_elsewhere(horovod_runs):
    ends_elsewhere_unloaded(*horovod_runs, ("codes_optimizer",))


def test_horovod_ends_on_the_same_bits_as_the_tree_before(horovod_runs, request):
    levels = request.node.callspec.params["horovod_runs"]
    recorded_bits.same_bits("torch", {f"horovod/{levels}/{s}": horovod_runs[0][0][s] for s in HOROVOD_SETTINGS})


def test_ddp_and_fsdp2_end_on_the_same_bits_as_the_tree_before(runs):
    recorded_bits.same_bits("torch", {f"ddp/{s}": runs[0][0][s] for s in DDP_SETTINGS})


@pytest.fixture(scope="module", params=["flat", pytest.param("two_levels", marks=pytest.mark.slow)])
def tf_runs(tmp_path_factory, request):
    return horovod_resumed(tmp_path_factory.mktemp(f"tf_resume_{request.param}"), "tf_resume_checks.py", "tf",
                           request.param)


def test_the_tensorflow_tape_resumes_on_the_same_bits(tf_runs):
    straight, resumed = tf_runs
    for rank in range(len(straight)):
        for setting in TF_SETTINGS:
            assert np.isfinite(straight[rank][setting]).all()
            assert straight[rank][setting].tobytes() == resumed[rank][setting].tobytes(), (setting, rank)
            assert straight[rank][setting].tobytes() == straight[0][setting].tobytes(), (setting, rank)
    ends_elsewhere_unloaded(straight, resumed, ("feedback",))


def test_tensorflow_ends_on_the_same_bits_as_the_tree_before(tf_runs, request):
    levels = request.node.callspec.params["tf_runs"]
    recorded_bits.same_bits("tensorflow", {f"tf/{levels}/{s}": tf_runs[0][0][s] for s in TF_SETTINGS})


def test_a_state_resumed_on_another_world_or_some_ranks_only_fails_on_every_rank():
    """Residuals belong to the world they were made in: loading them into 3 ranks, or on some
    ranks only, raises the same clear error on every rank (the metadata allreduce carries what
    each rank resumed from) instead of drifting or hanging; on_world_change() is the reset."""
    import hvd_aps
    from hvd_aps import emulate

    def compressors(n):
        return [hvd_aps.APSCompressor("e3m0", error_feedback=True, chunk_bytes=0, seed=1) for _ in range(n)]

    def grads(n):
        rng = np.random.default_rng(0)
        return [[rng.standard_normal(6000).astype(np.float32)] for _ in range(n)]

    two = compressors(2)
    emulate.codes_allreduce(two, grads(2))
    saved = [c.state_dict() for c in two]
    assert [s["world"] for s in saved] == [2, 2]
    three = compressors(3)
    for c, state in zip(three, saved + [saved[0]]):
        c.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by exchanges over 2 ranks and is resumed over 3"):
        emulate.codes_allreduce(three, grads(3))
    some = compressors(2)
    some[0].load_state_dict(saved[0])
    with pytest.raises(ValueError, match="some loaded a state_dict saved on 2 ranks and others none"):
        emulate.codes_allreduce(some, grads(2))
    for c in three:
        c.on_world_change()
    emulate.codes_allreduce(three, grads(3))  # the documented reset
    resumed = compressors(2)
    for c, state in zip(resumed, saved):
        c.load_state_dict(state)
    again = emulate.codes_allreduce(resumed, grads(2))
    assert again[0].tobytes() == emulate.codes_allreduce(two, grads(2))[0].tobytes()


def test_a_state_loaded_on_some_ranks_of_two_levels_fails_and_a_full_load_resumes():
    """2 hosts x 2 ranks (the exchange's in-process model of two levels), error feedback: a
    state_dict loaded on some ranks only raises the same clear error (no wait in the host level's
    residual move); loaded on every rank, the next step is the one the saving job would take."""
    import hvd_aps
    from hvd_aps import emulate

    def compressors():
        return [hvd_aps.APSCompressor("e3m0", error_feedback=True, chunk_bytes=0, seed=1) for _ in range(4)]

    grads = [[np.random.default_rng(r).standard_normal(6000).astype(np.float32)] for r in range(4)]
    saving = compressors()
    emulate.codes_allreduce(saving, grads, ranks_per_host=2)
    saved = [c.state_dict() for c in saving]
    for loaded in ([0], [0, 1], [1, 2, 3]):
        some = compressors()
        for r in loaded:
            some[r].load_state_dict(saved[r])
        with pytest.raises(ValueError, match="some loaded a state_dict saved on 2 ranks and others none"):
            emulate.codes_allreduce(some, grads, ranks_per_host=2)
    resumed = compressors()
    for c, state in zip(resumed, saved):
        c.load_state_dict(state)
    again = emulate.codes_allreduce(resumed, grads, ranks_per_host=2)
    assert again[0].tobytes() == emulate.codes_allreduce(saving, grads, ranks_per_host=2)[0].tobytes()


def test_a_state_saved_by_an_earlier_tree_resumes_on_its_bits():
    """A state_dict saved by the tree of commit 170dc6e (tests/data/make_resume_state.py run there)
    loads into this tree's compressors and the next steps give that tree's bits: saved states
    survive the code's changes."""
    import pickle
    import pathlib
    from data import make_resume_state as case
    from hvd_aps import emulate
    with open(pathlib.Path(__file__).parent / "data" / "resume_170dc6e.pkl", "rb") as f:
        saved = pickle.load(f)
    resumed = case.compressors()
    for compressor, state in zip(resumed, saved["states"]):
        compressor.load_state_dict(state)
    for step, want in zip(range(case.SAVED_AFTER, case.STEPS), saved["results"]):
        got = emulate.codes_allreduce(resumed, case.grads(step))
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want], step
