"""The groups of an exchange in a Horovod job, for horovod.torch and horovod.tensorflow alike:
flat (the global process set), or two levels (this rank's host and its cross group).

With dynamic process sets (hvd.init(process_sets="dynamic")) the groups are process sets, found
or added alike on every rank, every local set then every cross set. With a plain hvd.init()
they are exchange.Subgroup views of the global process set (its alltoall with empty messages
to the ranks outside the group), so two levels need nothing from the user. hvd.shutdown()
(Horovod elastic's reset) drops every set but the global one: forget() then makes them anew.
For horovod.torch, float32 inside a host goes through shared memory on the CPU
(hvd_aps._host_memory), the host's group carrying CUDA tensors.
"""
import dataclasses
import os
import socket
import threading
import warnings

from . import _host_memory, exchange
from ._topology import Topology


class HorovodLevels:
    """exchange.Levels per `hierarchical` setting for one Horovod framework module `hvd`, whose
    process sets `collectives(process_set)` wraps."""

    def __init__(self, hvd, collectives, host_memory: bool = False):
        # host_memory: eager collectives, whose host level may go through shared memory
        self._hvd, self._collectives, self._host_memory = hvd, collectives, host_memory
        self._made, self._lock = {}, threading.Lock()

    def get(self, hierarchical) -> exchange.Levels:
        """Collective the first time (every rank gathers every rank's host)."""
        with self._lock:
            if hierarchical not in self._made:
                self._made[hierarchical] = self._make(hierarchical)
            return self._made[hierarchical]

    def forget(self) -> None:
        with self._lock:
            made, self._made = self._made, {}
        for levels in made.values():
            if isinstance(levels.local, _host_memory.HostMemory):
                levels.local.close()

    def _make(self, hierarchical) -> exchange.Levels:
        hvd = self._hvd
        world = self._collectives(hvd.global_process_set)
        if hierarchical is False or hvd.size() == 1:
            return exchange.Levels.flat(world)
        place = (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), hvd.local_rank(), hvd.local_size(),
                 *_host_memory.place())
        places = hvd.allgather_object(place, name="hvd_aps.topology")
        topology = Topology.from_places([p[:2] for p in places])
        if not _agrees_with_horovod(topology, places) or not topology.two_levels(hierarchical):
            return exchange.Levels.flat(world)
        rank = hvd.rank()
        cross, local = topology.cross_group(rank), topology.local_group(rank)
        try:
            sets = {group: self._process_set(group) for group in topology.groups()}
            levels = exchange.Levels(world, self._collectives(sets[cross]), self._collectives(sets[local]))
        except ValueError as err:
            if "HOROVOD_DYNAMIC_PROCESS_SETS" not in str(err):
                raise
            levels = self._subgroups(world, cross, local)
        if levels.local is None or not self._host_memory:
            return levels
        gather = lambda obj: hvd.allgather_object(obj, name="hvd_aps.host_memory")  # noqa: E731
        memory = _host_memory.connect(topology, places, rank, gather, fallback=levels.local)
        return levels if memory is None else dataclasses.replace(levels, local=memory)

    @staticmethod
    def _subgroups(world, cross, local) -> exchange.Levels:
        """Two levels over the global process set (no dynamic process sets), where the launcher
        numbered the ranks so that every group is ascending (horovodrun does: a host's ranks in
        local-rank order); flat codes otherwise."""
        if list(cross) != sorted(cross) or list(local) != sorted(local):
            warnings.warn("hvd_aps: the ranks' numbering does not follow their hosts, so without dynamic process "
                          "sets codes go between every pair of ranks; hvd.init(process_sets='dynamic') enables the "
                          "two-level exchange", RuntimeWarning, stacklevel=6)
            return exchange.Levels.flat(world)
        return exchange.Levels(world, exchange.Subgroup(world, cross), exchange.Subgroup(world, local))

    def _process_set(self, ranks):
        """The process set of these ranks: the one that exists (made at hvd.init or for another
        compressor), else a new one."""
        hvd = self._hvd
        for set_id, members in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items():
            if tuple(members) == tuple(ranks):
                found = hvd.ProcessSet(list(ranks))
                found.process_set_id = set_id
                return found
        return hvd.add_process_set(list(ranks))


def _agrees_with_horovod(topology: Topology, places: list) -> bool:
    """Whether the hosts found by name hold the ranks Horovod counts as local (under MPI: MPI's
    shared-memory communicator; under Gloo: horovodrun's host assignment). Where they do not (one
    hostname for several machines, containers sharing a name), the exchange stays flat, with a
    warning on every rank alike: a wrong host level would read shared memory that is not shared."""
    wrong = [r for r, (_, local, size, *_) in enumerate(places)
             if (group := topology.local_group(r)).index(r) != local or len(group) != size]
    if wrong:
        warnings.warn(f"hvd_aps: the hosts found by hostname do not hold the ranks Horovod counts as local "
                      f"(ranks {wrong[:8]}); the exchange stays flat. Give each host its own HOROVOD_HOSTNAME "
                      "or hostname.", RuntimeWarning, stacklevel=3)
    return not wrong

