"""Faults a cluster meets, with real processes: a worker SIGKILLed mid-step under torchrun's
restarts, on two hosts (to hvd_aps: two levels through shared memory), for the DDP hook, FSDP2 and
HSDP."""
import json
import sys

import numpy as np
import pytest

from horovod_run import WORKERS, bounded, free_port, horovodrun, load, worker_env
from hvd_aps import _host_memory
from workers.common import KILL_STEP, KILLED_PHASES as PHASES, KILLED_STEPS as STEPS

HOSTS, PER_HOST = 2, 2


def torchrun_restarting(tmp_path, kill, timeout=420):
    """torchrun with 3 restarts, HOSTS x PER_HOST ranks in one agent; the worker numbers its host
    (GROUP_RANK) from its local rank, so hvd_aps runs two levels as on HOSTS machines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(HOSTS * PER_HOST),
           "--max-restarts", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--monitor-interval", "0.5", str(WORKERS / "killed_checks.py"), str(tmp_path), str(int(kill)), str(PER_HOST)]
    bounded(cmd, timeout, worker_env(HVD_APS_THREADS="1"))


def attempts_of(phase_index, killed):
    """The attempt (torchrun's restart count) that trained each step of a phase: never killed,
    all the first; killed, each phase's kill (one per phase, in order) ends an attempt during
    step KILL_STEP, and the next attempt trains from the checkpoint of the step before it."""
    if not killed:
        return [0] * STEPS
    return [phase_index] * (KILL_STEP - 1) + [phase_index + 1] * (STEPS - KILL_STEP + 1)


@pytest.mark.slow  # a minute of killing and resuming: .ci/run and scripts/soak.sh (pytest.ini)
def test_a_worker_killed_mid_step_resumes_from_checkpoints_on_the_bits_of_a_run_never_killed(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    torchrun_restarting(straight, kill=False)
    torchrun_restarting(killed, kill=True)
    want, got = load(straight, "killed0", HOSTS * PER_HOST), load(killed, "killed1", HOSTS * PER_HOST)
    for rank in range(HOSTS * PER_HOST):
        for run, ranks in (("straight", want), ("killed", got)):
            # two levels: the DDP hook's host level in shared memory, HSDP's replicas on each host
            assert bool(ranks[rank]["ddp_host_memory"]) and int(ranks[rank]["hsdp_hosts"]) == HOSTS, f"{run} {rank}"
            for i, phase in enumerate(PHASES):
                assert list(ranks[rank][f"{phase}_attempts"]) == attempts_of(i, run == "killed"), f"{run} {phase}"
        for phase in PHASES:
            assert np.isfinite(want[rank][phase]).all()
            assert got[rank][phase].tobytes() == want[rank][phase].tobytes(), f"rank {rank}: {phase}"
    left = _host_memory.stale()
    assert not left, f"files of dead processes left in /dev/shm: {left}"


# Horovod's own waits: its stall check ends them under Gloo ---------------------------------------------
STALL_CHECK_S, STALL_SHUTDOWN_S = 2, 10
STALL_BOUND_S = 120  # the job's own end comes in about STALL_SHUTDOWN_S + Horovod's start


@pytest.mark.parametrize("mode", ["torch", pytest.param("tensorflow", marks=pytest.mark.slow), "one-line"])
def test_horovods_stall_check_ends_a_wait_for_a_tensor_a_live_peer_never_submits(tmp_path, mode):
    """2 ranks under horovodrun --gloo, each waiting for a tensor the other never submits (the one
    line: a layer only rank 0 builds). With Horovod's stall check set, every rank gets an error
    naming the shutdown within the set time, instead of waiting for ever (scripts/build_horovod.py's
    patch of its Gloo controller)."""
    env = worker_env(HOROVOD_STALL_CHECK_TIME_SECONDS=str(STALL_CHECK_S),
                     HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=str(STALL_SHUTDOWN_S))
    run = horovodrun("stall_checks.py", tmp_path, args=(mode,), timeout=STALL_BOUND_S, env=env)
    assert "Stalled ranks" in run.stdout + run.stderr or "stalled" in (run.stdout + run.stderr).lower()
    for rank in range(2):
        got = json.loads((tmp_path / f"stall_rank{rank}.json").read_text())
        assert got["error"] and "shut down" in got["error"].lower(), (rank, got)
        assert got["seconds"] < STALL_SHUTDOWN_S + 30, (rank, got)
