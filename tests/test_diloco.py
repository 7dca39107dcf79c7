"""hvd_aps.diloco.DiLoCo under real ranks (torchrun with Gloo on loopback; Horovod's horovodrun):
every step's parameters those of DiLoCo written again in this process (tests/replay.py), float32,
codes with error feedback and streaming fragments; identical on every worker after each sync; a
fresh process resumed from a checkpoint taken while an exchange was under way ends on the same
bits; workers that disagree on the settings are refused, naming what differs; INTELLECT-1's int8
ring (hvd_aps.diloco_peers) on real ranks gives the bits of its arithmetic in one process."""
import numpy as np
import pytest

import replay
from horovod_run import horovodrun, load, torchrun, worker_env
from hvd_aps import diloco_peers
from workers.common import DILOCO_SETTINGS, DILOCO_STEPS, RING_SIZES, diloco_settings, ring_input

SAVED_AFTER = 6  # diloco_checks.py's checkpoint
FRAGMENTS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1], [2, 3, 4, 5]]}  # sizes 2048, 64, 4096, 64, 512, 8: halves
RANKS = 2


def launched(tmp, backend):
    runs = {}
    for mode in ("straight", "second"):
        env = worker_env(HVD_APS_BACKEND=backend, HVD_APS_MODE=mode)
        if backend == "torch":
            torchrun("diloco_checks.py", tmp, ranks=RANKS, env=env)
        else:
            horovodrun("diloco_checks.py", tmp, ranks=RANKS, env=env)
        runs[mode] = load(tmp, f"diloco_{backend}_{mode}", RANKS)
    return runs


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    return launched(tmp_path_factory.mktemp("diloco_torch"), "torch")


@pytest.mark.parametrize("setting", list(DILOCO_SETTINGS))
def test_every_step_is_dilocos_written_again(torch_runs, setting):
    options = DILOCO_SETTINGS[setting]
    want = replay.diloco(options, FRAGMENTS[options.get("fragments", 1)])
    for r, got in enumerate(torch_runs["straight"]):
        steps = got[setting]
        assert steps.shape == (DILOCO_STEPS, want[r].shape[1])
        bad = [k for k in range(DILOCO_STEPS) if steps[k].tobytes() != want[r][k].tobytes()]
        assert not bad, (setting, r, bad)


@pytest.mark.parametrize("setting", list(DILOCO_SETTINGS))
def test_workers_hold_the_same_parameters_after_each_sync_and_not_between(torch_runs, setting):
    options = DILOCO_SETTINGS[setting]
    fragments, every = options.get("fragments", 1), options["sync_every"] // options.get("fragments", 1)
    first, second = (r[setting] for r in torch_runs["straight"])
    cuts = np.cumsum([0, 2048, 64, 4096, 64, 512, 8])
    for step in range(DILOCO_STEPS):
        applied = (step + 1 - options.get("delay", 0)) % every == 0 and step + 1 > options.get("delay", 0)
        f = ((step + 1 - options.get("delay", 0)) // every - 1) % fragments
        part = FRAGMENTS[fragments][f]
        lo, hi = cuts[part[0]], cuts[part[-1] + 1]
        if applied and options.get("mix", 0) == 0:
            assert first[step][lo:hi].tobytes() == second[step][lo:hi].tobytes(), (setting, step)
        if not applied:
            assert first[step].tobytes() != second[step].tobytes(), (setting, step)


@pytest.mark.parametrize("setting", list(DILOCO_SETTINGS))
def test_a_resumed_worker_ends_on_the_bits_of_one_never_stopped(torch_runs, setting):
    """The checkpoint after step 6: streaming's fragment 0 is under way (started after step 6,
    applied after 7), the outer momentum and the codes' residuals non-zero."""
    for straight, second in zip(torch_runs["straight"], torch_runs["second"]):
        assert second[setting].tobytes() == straight[setting][SAVED_AFTER:].tobytes(), setting


@pytest.mark.parametrize("size", RING_SIZES)
def test_intellect1s_ring_on_real_ranks_gives_the_bits_of_its_arithmetic_in_one_process(torch_runs, size):
    want = diloco_peers.intellect1_int8_allreduce([ring_input(size, r) for r in range(RANKS)])
    for r in torch_runs["straight"]:
        assert r[f"ring{size}"].tobytes() == want.tobytes(), size


def test_a_checkpoint_resumes_only_under_the_outer_exchange_it_was_saved_with(torch_runs):
    for r in torch_runs["straight"]:
        assert str(r["outer_mismatch"]).startswith("this state_dict was saved with the outer exchange float32 and is "
                                                   "loaded with Intellect1Int8Ring"), r["outer_mismatch"]


def test_workers_that_disagree_on_the_settings_are_refused_on_every_rank(torch_runs):
    for r in torch_runs["straight"]:
        assert "sync_every: 4 on rank 0, 5 on rank 1" in str(r["mismatch"])


def test_horovod_workers_take_the_same_steps_as_torch_distributeds(tmp_path):
    runs = launched(tmp_path, "horovod")
    for setting in diloco_settings("horovod"):
        options = DILOCO_SETTINGS[setting]
        want = replay.diloco(options, FRAGMENTS[options.get("fragments", 1)])
        for r, got in enumerate(runs["straight"]):
            assert got[setting].tobytes() == want[r].tobytes(), (setting, r)
            assert runs["second"][r][setting].tobytes() == got[setting][SAVED_AFTER:].tobytes(), (setting, r)


def test_the_schedule_staggers_fragments_and_refuses_what_cannot_run():
    from hvd_aps.diloco import Schedule
    schedule = Schedule(12, fragments=3, delay=2)
    assert [(t, schedule.starting(t)) for t in range(1, 25) if schedule.starting(t) is not None] == [
        (4, 0), (8, 1), (12, 2), (16, 0), (20, 1), (24, 2)]
    assert [t for t in range(1, 13) if Schedule(4).starting(t) is not None] == [4, 8, 12]
    for bad, match in ((dict(sync_every=10, fragments=3), "multiple of fragments"),
                       (dict(sync_every=12, fragments=3, delay=4), r"delay must be an int in 0\.\.3"),
                       (dict(sync_every=12, delay=True), "delay must be an int"),
                       (dict(sync_every=0), "sync_every must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            Schedule(**bad)


def test_fragments_are_runs_of_consecutive_parameters_of_about_equal_size():
    import torch
    from hvd_aps.diloco import _cut
    named = [(str(i), torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 10, 10, 10, 100, 5])]
    assert [[n for n, _ in part] for part in _cut(named, 2)] == [["0", "1", "2", "3"], ["4", "5"]]
    assert [[n for n, _ in part] for part in _cut(named, 6)] == [[str(i)] for i in range(6)]
    with pytest.raises(ValueError, match="fragments \\(7\\) must not exceed the model's 6 parameters"):
        _cut(named, 7)


def test_diloco_refuses_bad_settings_before_it_claims_or_communicates():
    import torch
    import hvd_aps
    import hvd_aps.diloco
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mix must lie in \\[0, 1\\)"):
        hvd_aps.diloco.DiLoCo(model, inner, sync_every=4, mix=1.0)
    with pytest.raises(TypeError, match="an hvd_aps.APSCompressor sending codes, an OuterAverage or None"):
        hvd_aps.diloco.DiLoCo(model, inner, sync_every=4, compression="e4m3")
    with pytest.raises(TypeError, match="an OuterAverage exchanges over torch.distributed: use backend='torch'"):
        hvd_aps.diloco.DiLoCo(model, inner, sync_every=4, compression=diloco_peers.Intellect1Int8Ring(),
                              backend="horovod")
    compressor = hvd_aps.APSCompressor("e4m3")
    with pytest.raises(ValueError, match="must not exceed the model's 2 parameters"):
        hvd_aps.diloco.DiLoCo(model, inner, sync_every=4, fragments=4, compression=compressor, backend="torch")
    compressor.claim("another user")  # not claimed by the refused DiLoCo


def test_diloco_across_sites_over_fsdp2_inside_each_syncs_every_shard_with_its_replica(tmp_path):
    """Two sites of two FSDP2 ranks, DiLoCo over the replicate group: after every sync each shard
    holds the same bits as its replica on the other site, and between syncs (each site its own
    batches) they differ."""
    torchrun("diloco_fsdp_checks.py", tmp_path, ranks=4)
    ranks = load(tmp_path, "diloco_fsdp", 4)
    for shard in (0, 1):
        first, second = (r["shards"] for r in ranks if int(r["shard"]) == shard)
        for step in range(DILOCO_STEPS):
            synced = (step + 1) % DILOCO_SETTINGS["codes"]["sync_every"] == 0
            assert (first[step].tobytes() == second[step].tobytes()) == synced, (shard, step)
