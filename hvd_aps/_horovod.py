"""The groups of an exchange in a Horovod job, for horovod.torch and horovod.tensorflow alike:
flat (the global process set), or two levels (this rank's host and its cross group).

With hvd.init(process_sets="dynamic") the groups are process sets, found or added alike on every
rank (every local set, then every cross set); with a plain hvd.init() they are exchange.Subgroup
views of the global set (its alltoall with empty messages to the ranks outside), so two levels
need nothing from the user. hvd.shutdown() (Horovod elastic's reset) drops every set but the
global one: forget() makes them anew. An exchange on another process set stays flat on it: its
hosts' ranks are not Horovod's local ranks, and adding sets is collective over every rank. For
horovod.torch, float32 inside a host goes through shared memory on the CPU (hvd_aps._host_memory).

call_site() reads a gradient's name and process set from the Horovod function that called
compress(t). A collective some rank never joins never ends in Horovod (its waits have no bound),
so the codes path waits `timeout` seconds (APSConfig.timeout) and then raises no_answer().
"""
import dataclasses
import functools
import os
import socket
import threading
import warnings
from typing import NamedTuple, Optional

from . import _host_memory, exchange
from ._topology import Topology
from .config import DEFAULT_TIMEOUT


# compress()'s caller, or a comprehension over a group's tensors and then Horovod's function: the
# frames looked at above compress() for Horovod's locals
CALL_DEPTH = 2
_HOROVOD_DIR = os.sep + "horovod" + os.sep


class Site(NamedTuple):
    """Where Horovod asked for a gradient's compression: its key (the name Horovod negotiates it
    by, None where the caller gave none), the process set its allreduce runs on (None: the
    global set) and the Horovod optimizer that asked (None: an allreduce function). A tuple:
    every gradient of every step makes one, and a frozen dataclass costs several times more."""
    key: Optional[str] = None
    process_set: object = None
    owner: object = None


NOWHERE = Site()


def call_site(frame) -> Site:
    """The Site of a compress() call whose caller is `frame`, read from the locals of the Horovod
    function that called it: the optimizer's (`self`: its process_set and parameter names, `p`
    the parameter), or allreduce()'s and grouped_allreduce()'s (`name`, `process_set`). Horovod
    0.28.1 hands compress() neither, and without the name the ranks could only match gradients
    by the order they arrive in, which differs where one rank's graph lacks a parameter."""
    element = None
    for _ in range(CALL_DEPTH):
        if frame is None or _HOROVOD_DIR not in frame.f_code.co_filename:
            return NOWHERE
        local = frame.f_locals
        if frame.f_code.co_name.startswith("<"):  # a comprehension: its element, then its function
            element = local.get("p", local.get("t", local.get("tensor")))
            frame = frame.f_back
            continue
        return _site_of(local, element)
    return NOWHERE


def _site_of(local: dict, element) -> Site:
    owner = local.get("self")
    if owner is not None and hasattr(owner, "_parameter_names"):  # Horovod's DistributedOptimizer
        param = element if element is not None else local.get("p")
        return Site(owner._parameter_names.get(param), owner.process_set, owner)
    if "process_set" not in local:  # a Horovod function this reading does not know
        _warn_unread(tuple(sorted(local)))
        return NOWHERE
    name, tensors = local.get("name"), local.get("tensors", local.get("tensor_list"))
    if name is not None and element is not None and tensors is not None:  # a named group: name and position
        name = next((f"{name}.{i}" for i, t in enumerate(tensors) if t is element), None)
    return Site(name, local.get("process_set"))


@functools.lru_cache(maxsize=1)
def _warn_unread(names: tuple) -> None:
    warnings.warn("hvd_aps: compress() was called from a Horovod function whose locals ("
                  f"{', '.join(names)}) hold no process set: its gradients go by arrival order on the global "
                  "set (the Horovod version this reads is 0.28.1)", RuntimeWarning, stacklevel=4)


def is_global(process_set) -> bool:
    return process_set is None or process_set.process_set_id == 0


def included(process_set) -> bool:
    """Whether this rank belongs to the process set (None: the global set)."""
    return is_global(process_set) or process_set.included()


def no_answer(seconds: float, what: str, process_set, rank: int, error: type = TimeoutError) -> TimeoutError:
    """The error every rank raises where its wait for the others in a collective ran out: what it
    waited for and where, what may differ, and that Horovod keeps the request (its background
    thread has no way to drop one), so nothing later in this Horovod session can be trusted.
    `error`: its class, a TimeoutError (hvd_aps.torch.adapter.NoAnswer where a reset can help)."""
    ranks = list(process_set.ranks)
    where = "the global process set" if is_global(process_set) else f"process set {process_set.process_set_id}"
    return error(f"hvd_aps: rank {rank} had no answer from the other ranks for {seconds:g} s in {what} on "
                 f"{where} (ranks {ranks}): do all ranks run the same model and optimizer on the same "
                 "process set, with equal APSCompressor settings? Horovod still holds this rank's request, "
                 "so the job cannot go on as it is: restart it, or hvd.shutdown() and hvd.init() on every "
                 "rank (APSCompressor(timeout=...) sets this wait)")


def set_key(process_set):
    """A process set as a key (None: the global set): its id and ranks, as a set removed and
    added again may take an id another held."""
    return None if is_global(process_set) else (process_set.process_set_id, tuple(process_set.ranks))


class HorovodLevels:
    """exchange.Levels per `hierarchical` setting and timeout for one Horovod framework module
    `hvd`, whose process sets `collectives(process_set, timeout)` wraps. `gather(obj, name,
    timeout)` gathers every rank's picklable obj (default: Horovod's allgather_object, whose
    wait has no bound)."""

    def __init__(self, hvd, collectives, host_memory: bool = False, gather=None):
        # host_memory: eager collectives, whose host level may go through shared memory
        self._hvd, self._collectives, self._host_memory = hvd, collectives, host_memory
        self._gather = gather or (lambda obj, name, timeout: hvd.allgather_object(obj, name=name))
        self._made, self._lock = {}, threading.Lock()

    def get(self, hierarchical, process_set=None, timeout: float = DEFAULT_TIMEOUT) -> exchange.Levels:
        """Collective the first time (every rank gathers every rank's host); on a process set
        other than the global one, flat on that set (module docstring)."""
        if not is_global(process_set):
            key = (set_key(process_set), timeout)
            with self._lock:
                if key not in self._made:
                    self._made[key] = exchange.Levels.flat(self._collectives(process_set, timeout))
                return self._made[key]
        with self._lock:
            if (hierarchical, timeout) not in self._made:
                self._made[(hierarchical, timeout)] = self._make(hierarchical, timeout)
            return self._made[(hierarchical, timeout)]

    def forget(self) -> None:
        with self._lock:
            made, self._made = self._made, {}
        for levels in made.values():
            if isinstance(levels.local, _host_memory.HostMemory):
                levels.local.close()

    def _make(self, hierarchical, timeout: float) -> exchange.Levels:
        hvd = self._hvd
        world = self._collectives(hvd.global_process_set, timeout)
        if hierarchical is False or hvd.size() == 1:
            return exchange.Levels.flat(world)
        place = (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), hvd.local_rank(), hvd.local_size(),
                 *_host_memory.place())
        places = self._gather(place, "hvd_aps.topology", timeout)
        topology = Topology.from_places([p[:2] for p in places])
        if not _agrees_with_horovod(topology, places) or not topology.two_levels(hierarchical):
            return exchange.Levels.flat(world)
        rank = hvd.rank()
        cross, local = topology.cross_group(rank), topology.local_group(rank)
        try:
            sets = {group: self._process_set(group) for group in topology.groups()}
            levels = exchange.Levels(world, self._collectives(sets[cross], timeout),
                                     self._collectives(sets[local], timeout))
        except ValueError as err:
            if "HOROVOD_DYNAMIC_PROCESS_SETS" not in str(err):
                raise
            levels = self._subgroups(world, cross, local)
        if levels.local is None or not self._host_memory:
            return levels
        gather = lambda obj: self._gather(obj, "hvd_aps.host_memory", timeout)  # noqa: E731
        memory = _host_memory.connect(topology, places, rank, gather, fallback=levels.local, timeout=timeout)
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

