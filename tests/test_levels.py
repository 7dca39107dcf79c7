"""Two levels (float32 inside a host, codes between hosts) with real processes on loopback that
believe they run on 2 hosts x 2 ranks (tests/hosts_run.py): every entry point against the NumPy
model of host sums in local-rank order, then the codes model across hosts, divided by N."""
import numpy as np
import pytest

import model
from horovod_run import load
from hosts_run import launch
from support import BIG, check_levels_ddp, want
from workers.common import CODES_SIZES

@pytest.fixture(scope="module", params=["dynamic", "plain", "plain-tcp"])
def torch_ranks(tmp_path_factory, request):
    """Two levels on Horovod's dynamic process sets, and on a plain hvd.init() (Subgroups of the
    global process set), float32 inside a host through shared memory, or with
    HVD_APS_HOST_MEMORY=0 through Horovod's alltoall."""
    tmp = tmp_path_factory.mktemp("levels_torch")
    launch("levels_torch_checks.py", tmp, args=[request.param])
    return request.param, load(tmp, f"levels_torch_{request.param}", 4)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn"])
def test_horovod_allreduce_on_two_levels_is_bit_exact(torch_ranks, fmt):
    mode, ranks = torch_ranks
    expected = want(BIG, CODES_SIZES, fmt)  # Horovod's grouped allreduce compresses in order
    for r in ranks:
        assert bool(r[f"levels_{fmt}"]) and bool(r[f"subgroups_{fmt}"]) == mode.startswith("plain")
        assert bool(r[f"host_memory_{fmt}"]) == (mode != "plain-tcp")
        for i in BIG:
            assert r[f"grouped_{fmt}_{i}"].tobytes() == expected[i].reshape(CODES_SIZES[i]).tobytes(), (fmt, i)


def test_codes_optimizer_on_two_levels_is_bit_exact(torch_ranks):
    expected = want(BIG[::-1], CODES_SIZES)  # its bucket holds them in reverse order
    for r in torch_ranks[1]:
        for i in BIG:
            assert r[f"optimizer_{i}"].tobytes() == expected[i].reshape(CODES_SIZES[i]).tobytes(), i


def test_each_rank_sends_codes_of_its_slice_only(torch_ranks):
    """Two levels: a rank's codes cover its 1/L slice and go to one rank (the other host):
    about half of what the flat exchange sends among 4 ranks (2 (N-1)/N of the whole bucket)."""
    elements = sum(int(np.prod(CODES_SIZES[i])) for i in BIG)
    two = np.mean([int(r["bytes_e4m3"]) for r in torch_ranks[1]])
    flat = np.mean([int(r["bytes_flat"]) for r in torch_ranks[1]])
    assert two < 0.5 * flat and elements / 2 * 0.9 <= two <= elements / 2 + 2 * model.BLOCK


def test_horovod_tensorflow_on_two_levels_is_bit_exact(tmp_path):
    launch("levels_tf_checks.py", tmp_path)
    ranks = load(tmp_path, "levels_tf", 4)
    in_order, reverse = want(BIG, CODES_SIZES), want(BIG[::-1], CODES_SIZES)
    for r in ranks:
        assert bool(r["subgroups"])
        for i in BIG:
            assert r[f"grouped_{i}"].tobytes() == in_order[i].reshape(CODES_SIZES[i]).tobytes(), i
            assert r[f"tape_{i}"].tobytes() == reverse[i].reshape(CODES_SIZES[i]).tobytes(), i


def test_ddp_hook_and_fsdp_hsdp_on_two_levels(tmp_path):
    launch("levels_ddp_checks.py", tmp_path, horovod=False)
    ranks = load(tmp_path, "levels_ddp", 4)
    check_levels_ddp(ranks)
    # codes across hosts train as torch's own HSDP does (hsdp_mesh: its 2-D mesh), to e4m3's precision
    moved = ranks[0]["hsdp_torch"] - ranks[0]["hsdp_before"]
    off = np.linalg.norm(ranks[0]["hsdp"] - ranks[0]["hsdp_torch"]) / np.linalg.norm(moved)
    assert off < 0.05 and np.linalg.norm(moved) > 0.1


def test_the_hosts_of_torch_distributed_ranks_come_from_their_launcher(monkeypatch):
    """torchrun's numbering first, then a Slurm step's (srun starting every rank itself), then the
    hostname and local rank 0."""
    import socket

    from hvd_aps._topology import HOST_VARS, LOCAL_RANK_VARS, launcher_place
    for var in HOST_VARS + LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    assert launcher_place() == (socket.gethostname(), 0)
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert launcher_place() == ("3", 2)
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launcher_place() == ("1", 0)


class HorovodOf:
    """What hvd_aps asks a Horovod module for, on rank `rank` of 4 ranks whose places (hostname,
    local rank) the allgather hands back, while Horovod counts `local_size` ranks as local."""
    global_process_set = "global"

    def __init__(self, rank, names, local_size):
        self._rank, self._names, self._local_size = rank, names, local_size

    def size(self):
        return len(self._names)

    def rank(self):
        return self._rank

    def local_rank(self):
        return self._rank % self._local_size

    def local_size(self):
        return self._local_size

    def allgather_object(self, place, name):
        return [(host, r % self._local_size, self._local_size, *place[3:]) for r, host in enumerate(self._names)]


@pytest.mark.parametrize("names, local_size", [(["node"] * 4, 2), (["a", "a", "b", "b"], 4)],
                         ids=["one_name_for_two_machines", "two_names_on_one_machine"])
def test_hostnames_that_disagree_with_horovods_local_ranks_keep_the_exchange_flat_with_a_warning(names, local_size):
    """Two machines under one hostname, or one machine whose containers have names of their own:
    the hosts found by name do not hold the ranks Horovod counts as local, so a host level could
    read shared memory that is not shared; every rank warns and the exchange stays flat."""
    from hvd_aps._horovod import HorovodLevels
    for rank in range(len(names)):
        levels = HorovodLevels(HorovodOf(rank, names, local_size), lambda process_set, timeout: process_set)
        with pytest.warns(RuntimeWarning, match="found by hostname do not hold the ranks Horovod counts as local"):
            got = levels.get(None)
        assert (got.world, got.cross, got.local) == ("global", "global", None)
