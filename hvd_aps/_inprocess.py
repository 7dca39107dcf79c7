"""Ranks as threads of one process: collectives that meet at a barrier. The emulator
(hvd_aps.emulate.codes_allreduce) runs the one exchange driver on them, flat or on two levels,
so what it computes is what real ranks compute, without launching processes."""
import concurrent.futures
import threading
from typing import Callable, List

import numpy as np

from . import exchange
from ._arrays import array_module

# Ranks that call different collectives fail (a missing part) rather than hang; a rank that raises
# elsewhere leaves the others waiting at most this long.
BARRIER_TIMEOUT_S = 300


class Group:
    """A group of thread ranks: where they post their parts and wait for each other."""

    def __init__(self, size: int):
        self.size, self.board = size, {}
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)


class ThreadCollectives(exchange.Eager):
    """Collectives between threads: each rank posts its part, all wait, each combines everyone's
    parts, all wait again (so no part is written over while another rank still reads it)."""

    def __init__(self, group: Group, rank: int, equal_allgather: bool = True):
        self.group, self.world, self.rank, self.equal_allgather = group, group.size, rank, equal_allgather

    def _everyone(self, name, value, combine):
        self.group.board[(name, self.rank)] = value
        self.group.barrier.wait()
        try:
            return combine([self.group.board[(name, r)] for r in range(self.world)])
        finally:
            self.group.barrier.wait()

    def max_allreduce(self, vector, name):
        return self._everyone(name, vector, lambda parts: array_module(vector).stack(parts).max(axis=0))

    def allreduce(self, values, name):
        def total(parts):  # in rank order: the same bits on every rank
            out = parts[0].copy()
            for p in parts[1:]:
                out += p
            return out
        return self._everyone(name, values, total)

    def alltoall(self, send, splits, name):
        def mine(parts):
            xp = array_module(send)  # NumPy, or CuPy where the exchange runs on a GPU
            cuts = [np.concatenate([[0], np.cumsum(s)]) for _, s in parts]
            return xp.concatenate([m[c[self.rank]:c[self.rank + 1]] for (m, _), c in zip(parts, cuts)])
        return self._everyone(name, (send, splits), mine)

    def allgather(self, message, name):
        return self._everyone(name, message, lambda parts: array_module(message).concatenate(parts))


def flat_levels(world: int, equal_allgather: bool = True) -> List[exchange.Levels]:
    """equal_allgather=False: messages of any sizes, as Horovod's allgather takes them."""
    group = Group(world)
    return [exchange.Levels.flat(ThreadCollectives(group, r, equal_allgather)) for r in range(world)]


def host_levels(hosts: int, ranks_per_host: int) -> List[exchange.Levels]:
    """Two levels: rank r = h * ranks_per_host + l on host h with local rank l."""
    world = Group(hosts * ranks_per_host)
    local = [Group(ranks_per_host) for _ in range(hosts)]
    cross = [Group(hosts) for _ in range(ranks_per_host)]
    return [exchange.Levels(ThreadCollectives(world, r),
                            ThreadCollectives(cross[r % ranks_per_host], r // ranks_per_host),
                            ThreadCollectives(local[r // ranks_per_host], r % ranks_per_host))
            for r in range(hosts * ranks_per_host)]


def subgroup_levels(hosts: int, ranks_per_host: int) -> List[exchange.Levels]:
    """Two levels whose host and cross groups are exchange.Subgroup views of one group of every
    rank (Horovod without dynamic process sets): every rank takes part in every collective."""
    world, n = Group(hosts * ranks_per_host), hosts * ranks_per_host
    levels = []
    for r in range(n):
        whole = ThreadCollectives(world, r, equal_allgather=False)
        host, local = divmod(r, ranks_per_host)
        host_ranks = range(host * ranks_per_host, (host + 1) * ranks_per_host)
        levels.append(exchange.Levels(whole, exchange.Subgroup(whole, range(local, n, ranks_per_host)),
                                      exchange.Subgroup(whole, host_ranks)))
    return levels


def run_ranks(fn: Callable[[int], object], world: int) -> list:
    """fn(rank) on one thread per rank -> the results in rank order (the first error raised)."""
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))
