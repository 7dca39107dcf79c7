"""The groups of an exchange in a Horovod job, for horovod.torch and horovod.tensorflow alike:
flat (the global process set), or two levels (this rank's host and cross process sets).

Process sets are found or added alike on every rank, every local set then every cross set.
Adding one needs Horovod's dynamic process sets (hvd.init(process_sets="dynamic")); without them
hierarchical=None stays flat with a warning, hierarchical=True says what to do. hvd.shutdown()
(Horovod elastic's reset) drops every set but the global one: forget() then makes them anew.
"""
import os
import socket
import threading
import warnings

from . import exchange
from ._topology import Topology


class HorovodLevels:
    """exchange.Levels per `hierarchical` setting for one Horovod framework module `hvd`, whose
    process sets `collectives(process_set)` wraps."""

    def __init__(self, hvd, collectives):
        self._hvd, self._collectives = hvd, collectives
        self._made, self._lock = {}, threading.Lock()

    def get(self, hierarchical) -> exchange.Levels:
        """Collective the first time (every rank gathers every rank's host)."""
        with self._lock:
            if hierarchical not in self._made:
                self._made[hierarchical] = self._make(hierarchical)
            return self._made[hierarchical]

    def forget(self) -> None:
        with self._lock:
            self._made.clear()

    def _make(self, hierarchical) -> exchange.Levels:
        hvd = self._hvd
        world = self._collectives(hvd.global_process_set)
        if hierarchical is False or hvd.size() == 1:
            return exchange.Levels.flat(world)
        place = (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), hvd.local_rank())
        topology = Topology.from_places(hvd.allgather_object(place, name="hvd_aps.topology"))
        if not topology.two_levels(hierarchical):
            return exchange.Levels.flat(world)
        try:
            sets = {group: self._process_set(group) for group in topology.groups()}
        except ValueError as err:
            if "HOROVOD_DYNAMIC_PROCESS_SETS" not in str(err):
                raise
            if hierarchical:
                raise ValueError("the two-level exchange adds Horovod process sets: call "
                                 "hvd.init(process_sets='dynamic') first") from err
            warnings.warn("hvd_aps: hosts hold several ranks, but Horovod was initialised without dynamic process "
                          "sets, so codes go between every pair of ranks; hvd.init(process_sets='dynamic') enables "
                          "the two-level exchange", RuntimeWarning, stacklevel=5)
            return exchange.Levels.flat(world)
        rank = hvd.rank()
        return exchange.Levels(world, self._collectives(sets[topology.cross_group(rank)]),
                               self._collectives(sets[topology.local_group(rank)]))

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
