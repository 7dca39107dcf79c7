"""Ranks as threads of one process: collectives that meet at a barrier, for testing the exchange
driver on flat and two-level groups without launching processes."""
import concurrent.futures
import threading

import numpy as np

from hvd_aps import exchange
from hvd_aps._arrays import array_module


class Group:
    """A group of thread ranks: where they post their parts and wait for each other."""

    def __init__(self, size):
        # a timeout: ranks that call different collectives fail instead of hanging
        self.size, self.board, self.barrier = size, {}, threading.Barrier(size, timeout=60)


class ThreadCollectives(exchange.Eager):
    """Collectives between threads: each rank posts its part, all wait, each reads everyone's."""

    def __init__(self, group, rank, equal_allgather=True):
        self.group, self.world, self.rank, self.equal_allgather = group, group.size, rank, equal_allgather

    def _everyone(self, name, value):
        self.group.board[(name, self.rank)] = value
        self.group.barrier.wait()
        values = [self.group.board[(name, r)] for r in range(self.world)]
        self.group.barrier.wait()
        return values

    def max_allreduce(self, vector, name):
        return np.max(self._everyone(name, vector), axis=0)

    def allreduce(self, values, name):
        parts = self._everyone(name, values)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total

    def alltoall(self, send, splits, name):
        cuts = [np.concatenate([[0], np.cumsum(s)]) for s in self._everyone(name + ".splits", splits)]
        sent = self._everyone(name, send)
        xp = array_module(send)  # NumPy, or CuPy where a test runs the exchange on a GPU
        return xp.concatenate([sent[r][cuts[r][self.rank]:cuts[r][self.rank + 1]] for r in range(self.world)])

    def allgather(self, message, name):
        return array_module(message).concatenate(self._everyone(name, message))


def flat_levels(world, equal_allgather=True):
    """equal_allgather=False: messages of any sizes, as Horovod's allgather takes them."""
    group = Group(world)
    return [exchange.Levels.flat(ThreadCollectives(group, r, equal_allgather)) for r in range(world)]


def host_levels(hosts, ranks_per_host):
    """Two levels: rank r = h * ranks_per_host + l on host h with local rank l."""
    world = Group(hosts * ranks_per_host)
    local = [Group(ranks_per_host) for _ in range(hosts)]
    cross = [Group(hosts) for _ in range(ranks_per_host)]
    return [exchange.Levels(ThreadCollectives(world, r), ThreadCollectives(cross[r % ranks_per_host], r // ranks_per_host),
                            ThreadCollectives(local[r // ranks_per_host], r % ranks_per_host))
            for r in range(hosts * ranks_per_host)]


def subgroup_levels(hosts, ranks_per_host):
    """Two levels whose host and cross groups are exchange.Subgroup views of one group of every
    rank (Horovod without dynamic process sets): every rank takes part in every collective."""
    world, n = Group(hosts * ranks_per_host), hosts * ranks_per_host
    levels = []
    for r in range(n):
        whole = ThreadCollectives(world, r, equal_allgather=False)
        host, local = divmod(r, ranks_per_host)
        levels.append(exchange.Levels(whole, exchange.Subgroup(whole, range(local, n, ranks_per_host)),
                                      exchange.Subgroup(whole, range(host * ranks_per_host, (host + 1) * ranks_per_host))))
    return levels


def run_ranks(fn, world):
    """fn(rank) on one thread per rank -> the results in rank order (the first error raised)."""
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))
