"""Float32 inside a host through shared memory (hvd_aps._host_memory), with real processes: every
local rank's alltoall and allgather results (concatenated, and handed over one writer at a time,
the alltoall's message written from pieces) against NumPy, message after message; nothing left
in /dev/shm; a rank that closes before a slow peer read its message; a peer that dies is
reported, not waited for, and one that runs but never comes is waited for `timeout` seconds
only; a full /dev/shm is an error that says what to do; files of dead processes are swept."""
import contextlib
import errno
import multiprocessing
import os
import secrets
import subprocess
import time

import numpy as np
import pytest

from hvd_aps import _host_memory
from hvd_aps._host_memory import HostMemory

pytestmark = pytest.mark.skipif(not _host_memory.available(), reason="needs /dev/shm and the host engine")
ROUNDS = 4  # more than the two messages after which a box's file is unlinked
WORLD = 3
PEER_SECONDS = 10  # how long the peer that never comes runs
JOIN_S = 30  # how long the ranks get to meet at the start, and to end once the test is done with them


def message(rank, step, n):
    return np.random.default_rng([rank, step]).standard_normal(n).astype(np.float32)


def splits_of(step):
    return [step + 1, 7, 2 * step]  # per destination, the same on every rank (the exchange's host scatter)


def pieces(send, step):
    """`send` as the arrays alltoall_each writes end to end: cut across the destinations' parts,
    one of them empty."""
    cuts = [3, 3, 9 + step]
    return np.split(send, cuts)


def local_rank(job, pids, rank, results):
    memory = HostMemory(job, 0, pids, rank)
    for step in range(ROUNDS):
        send = message(rank, step, sum(splits_of(step)))
        results.put((rank, step, "alltoall", memory.alltoall(send, splits_of(step), "scatter")))
        results.put((rank, step, "allgather", memory.allgather(message(rank, step, 5 + rank), "gather")))
        for kind, run in (("allgather_each", lambda take: memory.allgather_each(message(rank, step, 6), "each", take)),
                          ("alltoall_each", lambda take: memory.alltoall_each(pieces(send, step), splits_of(step),
                                                                               "each2", take))):
            taken = []  # each part handed over from its writer's box, copied before it is acknowledged
            run(lambda writer, row: taken.append((writer, row.copy())))
            results.put((rank, step, kind, taken))
    memory.close()


@contextlib.contextmanager
def launched(target, *extra):
    """WORLD processes running target(job, pids, rank, results, *extra) -> (results queue, job, exit
    codes): on leaving, each rank gets JOIN_S to end, and one still running then is killed (-9)."""
    ctx = multiprocessing.get_context("fork")
    job, results, exits = secrets.token_hex(4), ctx.Queue(), []
    barrier = ctx.Barrier(WORLD, timeout=JOIN_S)
    shared = ctx.Array("q", WORLD)  # every rank's pid

    def child(rank):
        shared[rank] = os.getpid()
        barrier.wait()  # bounded: the barrier's timeout
        target(job, list(shared), rank, results, *extra)

    procs = [ctx.Process(target=child, args=(r,)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        yield results, job, exits
    finally:
        for p in procs:
            p.join(timeout=JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=JOIN_S)
            exits.append(p.exitcode)


def leftovers(job):
    return [f for f in os.listdir(_host_memory.DIRECTORY) if f".{job}." in f]


def test_alltoall_and_allgather_match_numpy_every_message_and_leave_nothing():
    got = {}
    with launched(local_rank) as (results, job, exits):
        for _ in range(WORLD * ROUNDS * 4):
            rank, step, kind, value = results.get(timeout=60)
            got[rank, step, kind] = value
    assert exits == [0] * WORLD
    for step in range(ROUNDS):
        bounds = np.cumsum([0] + splits_of(step))
        for rank in range(WORLD):
            want = np.concatenate([message(w, step, bounds[-1])[bounds[rank]:bounds[rank + 1]] for w in range(WORLD)])
            assert got[rank, step, "alltoall"].tobytes() == want.tobytes()
            gathered = np.concatenate([message(w, step, 5 + w) for w in range(WORLD)])
            assert got[rank, step, "allgather"].tobytes() == gathered.tobytes()
            assert [w for w, _ in got[rank, step, "allgather_each"]] == list(range(WORLD))
            for w, row in got[rank, step, "allgather_each"]:
                assert row.tobytes() == message(w, step, 6).tobytes()
            parts = [row for _, row in got[rank, step, "alltoall_each"]]
            assert np.concatenate(parts).tobytes() == want.tobytes() and len(parts) == WORLD
    assert leftovers(job) == []


def closes_at_once(job, pids, rank, results):
    memory = HostMemory(job, 0, pids, rank)
    if rank == 0:
        time.sleep(1.0)  # the others read its message and close before it opens their boxes
    results.put((rank, memory.allgather(message(rank, 0, 3 + rank), "gather")))
    memory.close()


def test_a_rank_that_closes_first_leaves_its_message_for_a_late_peer():
    with launched(closes_at_once) as (results, job, exits):
        got = dict(results.get(timeout=30) for _ in range(WORLD))
    assert exits == [0] * WORLD
    gathered = np.concatenate([message(w, 0, 3 + w) for w in range(WORLD)])
    for rank in range(WORLD):
        assert got[rank].tobytes() == gathered.tobytes()
    assert leftovers(job) == []


def dies_after_one(job, pids, rank, results):
    memory = HostMemory(job, 0, pids, rank)
    memory.allgather(np.zeros(4, np.float32), "gather")
    if rank == 1:
        os._exit(3)  # no cleanup: as a crash
    try:
        memory.allgather(np.zeros(4, np.float32), "gather")
        memory.allgather(np.zeros(4, np.float32), "gather")
        results.put((rank, "no error"))
    except RuntimeError as err:
        results.put((rank, str(err)))


def test_a_peer_that_exits_is_reported_and_its_files_are_swept():
    with launched(dies_after_one) as (results, job, exits):
        errors = dict(results.get(timeout=60) for _ in range(WORLD - 1))
    assert exits == [0, 3, 0]  # the crash's own code: the others ended by themselves
    for rank in (0, 2):
        assert "local rank 1" in errors[rank] and "exited" in errors[rank]
    _host_memory.sweep()  # the dead rank's box was never unlinked
    assert leftovers(job) == []


def test_a_peer_that_runs_but_never_comes_is_waited_for_timeout_seconds_only():
    """A peer that runs but never joins the collective (ranks that disagree): TimeoutError naming
    it once `timeout` has passed (looked at with the liveness check), not a wait until it ends
    (the peer, a sleep, exits after PEER_SECONDS: a wait without the bound ends with "exited")."""
    job, timeout = secrets.token_hex(4), 0.1
    peer = subprocess.Popen(["sleep", str(PEER_SECONDS)])
    memory = HostMemory(job, 0, [os.getpid(), peer.pid], 0, timeout=timeout)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"^hvd_aps: local rank 0 had no answer from local rank 1 of this "
                                               rf"host \(pid {peer.pid}\) for 0.1 s in gather"):
            memory.allgather(np.zeros(4, np.float32), "gather")
    finally:
        peer.kill()
        peer.wait(timeout=JOIN_S)
        memory.close(wait=0.0)  # the peer gone, its box goes too
    assert time.monotonic() - start < timeout + 4 * _host_memory.LIVENESS_SECONDS  # well short of PEER_SECONDS
    assert leftovers(job) == []


def test_a_full_dev_shm_says_what_to_do(monkeypatch, tmp_path):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    box = _host_memory._Box(str(tmp_path / "box"), 2, create=True)
    try:
        with pytest.raises(RuntimeError, match="shm-size"):
            box.reserve(1 << 20)
    finally:
        box.close()
