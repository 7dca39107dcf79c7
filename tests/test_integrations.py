"""The README's recipes for the launchers and wrappers users already have, with real processes on
the CPU: HF Accelerate and PyTorch Lightning (torchrun, 2 ranks, Gloo) and Horovod elastic
(horovodrun's elastic mode on localhost, a host-discovery script that grows the job; a worker
killed mid-step)."""
import os
import sys

import numpy as np
import pytest
import torch

from horovod_run import WORKERS, bounded, load, torchrun
from support import tensorboard_scalars


@pytest.fixture(scope="module")
def integrations_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrations")
    torchrun("integrations_checks.py", tmp, timeout=300)
    return tmp


@pytest.fixture(scope="module")
def ranks(integrations_dir):
    return load(integrations_dir, "integrations", 2)


@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_recipe_sends_codes_and_keeps_ranks_identical(ranks, framework):
    for r in ranks:
        assert r[framework].tobytes() == ranks[0][framework].tobytes()
        assert int(r[f"{framework}_buckets"]) == 5  # aps_hook ran every step
    # the same model, data and steps through both wrappers: the same bits
    assert ranks[0]["accelerate"].tobytes() == ranks[0]["lightning"].tobytes()


def test_horovod_elastic_keeps_each_ranks_compressor_state(tmp_path):
    """horovodrun's elastic mode grows the job from 2 to 3 ranks after step 4 (the discovery
    script reads a file rank 0 rewrites): the reset keeps each old rank's own residuals, drops
    the shard owners' (the old world's layout), and every rank ends with the same parameters."""
    hosts, discover = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts.write_text("localhost:2\n")
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "--network-interface", "lo", "-np", "2", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(discover), "--gloo", sys.executable, str(WORKERS / "elastic_checks.py"),
           str(tmp_path), str(hosts)]
    bounded(cmd, 240)
    ranks = [dict(np.load(tmp_path / f"elastic_{r}.npz")) for r in range(3)]
    assert all(int(r["size"]) == 3 for r in ranks)
    assert [int(r["resets"]) for r in ranks] == [1, 1, 0]  # rank 2 joined after the reset
    for r in ranks:
        assert bool(r["kept"]) and bool(r["owners_dropped"])
        assert r["params"].tobytes() == ranks[0]["params"].tobytes()


@pytest.mark.slow  # a minute each of recovery: .ci/run and scripts/soak.sh (pytest.ini)
@pytest.mark.parametrize("wrapper", ["one-line", "codes-optimizer"])
def test_horovod_elastic_survives_a_killed_worker_on_the_bits_of_a_job_never_interrupted(wrapper, tmp_path):
    """horovodrun's elastic mode, 3 ranks on two hosts (localhost:2, 127.0.0.1:1): the rank on
    127.0.0.1 SIGKILLs itself mid-backward at step 4 (workers/elastic_kill_checks.py). The two
    survivors restore the last commit and finish with 2 ranks on the bits of a plain 2-rank job
    that loads the state they restored (model, optimizer, compressor after on_world_change), which
    equals what each held at its last commit."""
    discover = tmp_path / "discover.sh"
    discover.write_text('#!/bin/sh\nprintf "localhost:2\\n127.0.0.1:1\\n"\n')
    discover.chmod(0o755)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    worker = [sys.executable, str(WORKERS / "elastic_kill_checks.py"), wrapper]
    for cmd in ([horovodrun, "--network-interface", "lo", "-np", "3", "--min-np", "2", "--max-np", "3",
                 "--host-discovery-script", str(discover), "--gloo", *worker, "elastic", str(tmp_path)],
                [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", *worker, "reference", str(tmp_path)]):
        bounded(cmd, 240)
    for rank in range(2):
        restored = torch.load(tmp_path / f"reset_rank{rank}.pt", weights_only=False)
        assert restored["step"] == 4  # the killed step was not committed
        # nor counted by the compressor (nor the zeros Horovod's broadcast_optimizer_state steps on)
        assert set(restored["compressor"]["steps"].values()) == {4}
        assert_is_the_last_commit(restored, restored["committed"])
        survivor, reference = (dict(np.load(tmp_path / f"{mode}_rank{rank}.npz")) for mode in ("elastic", "reference"))
        assert int(survivor["size"]) == 2
        assert survivor["params"].tobytes() == reference["params"].tobytes(), rank


def assert_is_the_last_commit(restored, committed):
    """A survivor's restored state equals what it held at its last commit, bit for bit: the model,
    the optimizer, and the compressor's step counts and every residual on_world_change keeps (its
    own; the shard owners' belong to the old world)."""
    assert restored["step"] == committed["step"]
    torch.testing.assert_close(restored["model"], committed["model"], rtol=0, atol=0)
    assert repr(restored["optimizer"]) == repr(committed["optimizer"])
    own = restored["compressor"]["residuals"]
    assert own and restored["compressor"]["steps"] == committed["compressor"]["steps"]
    for name, residual in own.items():
        assert residual.tobytes() == committed["compressor"]["residuals"][name].tobytes(), name


def test_the_fidelity_of_every_step_reaches_tensorboard_on_rank_zero(ranks, integrations_dir):
    """compressor.log_to through torch's SummaryWriter (rank 0 writes, rank 1 not) and
    hvd_aps.lightning.FidelityLogger through Lightning's TensorBoardLogger: relative error,
    flushed and saturated shares, bytes sent and the bucket's APS shift, one value a step."""
    torch_logs, other = tensorboard_scalars(integrations_dir / "tb_torch" / "rank0"), tensorboard_scalars(integrations_dir / "tb_torch" / "rank1")
    lightning_logs = tensorboard_scalars(integrations_dir / "tb_lightning")
    assert not other
    for logs in (torch_logs, lightning_logs):
        for tag in ("relative_error", "flushed", "saturated", "bytes_sent"):
            assert len(logs[f"hvd_aps/{tag}"]) == 5, (tag, sorted(logs))
        assert 0 < logs["hvd_aps/relative_error"][-1][1] < 0.1  # e4m3 with APS: a few percent
        assert all(value > 0 for _, value in logs["hvd_aps/bytes_sent"])
        assert any(tag.startswith("hvd_aps/shift/") for tag in logs)
    assert [step for step, _ in torch_logs["hvd_aps/flushed"]] == list(range(5))
