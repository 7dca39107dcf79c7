"""The two-level exchange as clusters launch it, on hosts that are network namespaces
(examples/netns_hosts.py, 2 hosts x 2 ranks): MPICH's mpirun with the hosts given (-hosts), the
same mpirun inside a faked Slurm allocation (Hydra reads the hosts from SLURM_JOB_NODELIST), and
torch.distributed started as `srun` starts tasks (the hosts told apart by SLURM_NODEID alone: every
namespace keeps this machine's hostname). Against the NumPy model of tests/test_levels.py.
Needs root and network namespaces; the MPI launches also Horovod built with MPI."""
import sys

import pytest

from horovod_run import WORKERS, bounded, load, worker_env
from support import BIG, SCRIPT, check_levels_ddp, namespaces_work, want
from workers.common import CODES_SIZES

HOSTS = SCRIPT.parent / "netns_hosts.py"
pytestmark = pytest.mark.skipif(not namespaces_work(), reason="needs root, ip and tc, and network namespaces")


def netns_launch(launcher, worker, tmp_path, *args):
    cmd = [sys.executable, str(HOSTS), "--launcher", launcher, "--timeout", "240", "--",
           sys.executable, str(WORKERS / worker), str(tmp_path), *args]
    bounded(cmd, 300, worker_env(HVD_APS_THREADS="1"))


def mpi_built():
    from horovod.common.util import mpi_built
    return mpi_built()


@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("slurm-mpirun", marks=pytest.mark.slow)])
def test_mpirun_across_hosts_runs_horovod_on_two_levels_bit_exact(launcher, tmp_path):
    """Horovod's MPI controller: its local ranks are MPI's (the shared-memory communicator of
    each host), the hosts' names their own; float32 inside a host through shared memory."""
    if not mpi_built():
        pytest.skip("Horovod built without MPI (HVD_APS_MPI=none)")
    netns_launch(launcher, "levels_torch_checks.py", tmp_path, "plain")
    expected = want(BIG, CODES_SIZES)
    for r in load(tmp_path, "levels_torch_plain", 4):
        assert bool(r["levels_e4m3"]) and bool(r["host_memory_e4m3"])
        for i in BIG:
            assert r[f"grouped_e4m3_{i}"].tobytes() == expected[i].reshape(CODES_SIZES[i]).tobytes(), i


def test_srun_tasks_run_the_ddp_hook_and_hsdp_on_two_levels(tmp_path):
    """The hosts come from SLURM_NODEID (hvd_aps._topology.launcher_place): DDP's hook and
    FSDP2's host mesh group the ranks by node, bit-exact against the model."""
    netns_launch("srun", "levels_ddp_checks.py", tmp_path)
    check_levels_ddp(load(tmp_path, "levels_ddp", 4))
