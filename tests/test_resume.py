"""Checkpoint and resume bit for bit: DDP with hvd_aps.ddp.aps_hook and FSDP2 with hvd_aps.fsdp
(real `torchrun` processes, Gloo on loopback), Horovod's DistributedOptimizer with APSCompressor
and hvd_aps.torch.DistributedOptimizer, TensorFlow's tape and Keras 3's model.fit (`horovodrun -np 2
--gloo`, and 2 hosts x 2 ranks on two levels). Each trains straight, or
half, saves (model, optimizer, compressor), and a fresh process loads and trains the rest. With
error feedback (residuals that DDP's rebuilt buckets and the resumed process's first buckets
lay out differently) and stochastic rounding (seeds from parameter names and steps), the two
runs end on the same bits on every rank. The straight run saves the checkpoint at half its steps
(a run never stopped, checkpointing), and the resumed one is a fresh process that loads it. The
straight runs end on the bits of the same training replayed in this process through the
in-process driver (tests/replay.py), on whatever machine the suite runs."""
import os

import numpy as np
import pytest

from horovod_run import horovodrun, load, torchrun
from hosts_run import launch
import replay
from workers.common import RESUME_DDP, RESUME_HOROVOD, RESUME_MODES, RESUME_PARAMS, RESUME_TF

RANKS = 2
DDP_SETTINGS = tuple(RESUME_DDP)
HOROVOD_SETTINGS = tuple(RESUME_HOROVOD)
TF_SETTINGS = tuple(RESUME_TF) + tuple(f"keras_{s}" for s in RESUME_TF)
HOROVOD_KEYS = [f"{layer}.{kind}" for layer in range(replay.LAYERS) for kind in ("weight", "bias")]
FSDP_NAMES = [f"fsdp.{layer}" for layer in range(replay.LAYERS)]  # hvd_aps.fsdp names a unit by its module


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


@pytest.mark.parametrize("setting", ("feedback", "codes_optimizer"))
def test_horovod_ends_on_the_bits_of_its_training_replayed_here(horovod_runs, setting, request):
    """Horovod's optimizer with the one line (error feedback), and the codes optimizer (with
    stochastic rounding too), flat and on two levels: rank 0's final parameters are those of the
    same training replayed in this process."""
    per_host = 1 if request.node.callspec.params["horovod_runs"] == "flat" else 2
    ranks = len(horovod_runs[0])
    want = replay.torch_allreduce(RESUME_HOROVOD[setting], HOROVOD_KEYS, ranks, per_host)
    assert horovod_runs[0][0][setting].tobytes() == want.tobytes(), setting


def test_horovod_ends_on_the_same_bits_on_another_schedule_and_engine(horovod_runs):
    """The one line with stochastic rounding (its seeds drawn from the names of Horovod's batches),
    trained in the same job again on chunks of 64 KiB and the NumPy engine: the same bits on every
    rank."""
    straight = horovod_runs[0]
    for r in range(len(straight)):
        assert straight[r]["stochastic"].tobytes() == straight[r]["stochastic_rescheduled"].tobytes(), r
    assert straight[0]["stochastic"].tobytes() != straight[0]["feedback"].tobytes()


@pytest.mark.parametrize("setting", DDP_SETTINGS)
def test_ddp_and_fsdp2_end_on_the_bits_of_their_training_replayed_here(runs, setting):
    """The DDP hook (the names it gave the parameters saved by the worker) and FSDP2's codes
    reduce-scatter (with or without its parameters gathered as codes): rank 0's final parameters
    are those of the same training replayed here."""
    straight = runs[0][0]
    if setting.startswith("fsdp"):
        want = replay.torch_fsdp(RESUME_DDP[setting], FSDP_NAMES, RANKS, RESUME_PARAMS.get(setting))
    else:
        want = replay.torch_allreduce(RESUME_DDP[setting], list(straight[f"{setting}_keys"]), RANKS)
    assert straight[setting].tobytes() == want.tobytes(), setting


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


@pytest.mark.parametrize("setting", TF_SETTINGS)
def test_tensorflow_hands_every_step_the_bits_of_its_exchange_replayed_here(tf_runs, setting, request):
    """TensorFlow's tape and Keras 3's fit: what the exchange handed each step's update on every
    rank is the in-process driver's average of the gradients the ranks computed in that step."""
    per_host = 1 if request.node.callspec.params["tf_runs"] == "flat" else 2
    straight = tf_runs[0]
    options = RESUME_TF[setting.removeprefix("keras_")]
    keys = list(straight[0][f"{setting}_keys"])
    local = [r[f"{setting}_local"] for r in straight]
    cuts = np.cumsum([0] + [128 * 128, 128, 128 * 128, 128])  # the TF workers' Dense kernels and biases
    for r, ranks in enumerate(straight):
        delivered = [[step[a:b] for a, b in zip(cuts[:-1], cuts[1:])] for step in ranks[f"{setting}_delivered"]]
        assert len(delivered) == 8, (setting, r)
        assert replay.steps_replayed(options, keys, local, delivered, per_host) == [], (setting, r)


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
