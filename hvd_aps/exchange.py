"""The one exchange driver: a bucket's codes exchange, with the collectives passed in.

Every codes path (Horovod's optimizers, hvd_aps.torch and .tensorflow, Keras 3, DDP, FSDP2) runs
through `run` with a `Collectives` per group of ranks: a few collectives and a way to run a host
stage (a plain call; tf.numpy_function in a TF graph). Stages: hvd_aps._stages.CodesStages'::

    0. two levels: alltoall of its slices in the host (CPU: _host_memory), summed in local-rank order
    1. stage: each tensor's max |g| and size, the signature;     collective: Max-allreduce (all ranks)
    2. stage: APS shifts and formats agreed, the chunks laid out
    per chunk (hvd_aps._schedule's chunking), pipelined: k encoded while k-1 travels, k-2 is decoded
    3. stage: encode every owner's part of the chunk;             collective: alltoall (codes group)
    4. stage: decode-and-sum this rank's part, re-encode it;      collective: allgather
    5. stage: decode every owner's part into the results
    6. two levels: allgather of the results' slices inside the host
"""
import abc
import dataclasses
import enum
import functools
import hashlib
import time
import warnings
from typing import Optional, Sequence

import numpy as np

from . import _arrays, _layout, _metadata
from ._schedule import NATIVE
from ._stages import Bucket, CodesStages, Exchange
from ._residuals import OWNER, SEND
from ._scatter import ScatterStages
from .config import Path, Policy


class Collectives(abc.ABC):
    """What the driver needs from a framework, for one group of ranks. Arrays in and out are the
    framework's own kind (NumPy/CuPy arrays for eager frameworks, tf.Tensor inside TF). Splits
    count elements of the array's dtype."""

    world: int
    rank: int
    eager: bool = True  # stages run as they are called (False: graph ops, whose shape is fixed when traced)
    equal_allgather: bool = True  # allgather takes messages of equal sizes only (torch.distributed's)

    @abc.abstractmethod
    def stage(self, fn, inputs: Sequence, dtypes: Sequence) -> tuple:
        """Run ``fn(*inputs)`` -> a tuple of arrays of `dtypes` (NumPy dtypes), return that tuple."""

    @abc.abstractmethod
    def max_allreduce(self, vector, name: str):
        """Elementwise max over the ranks of a float64 vector."""

    @abc.abstractmethod
    def alltoall(self, send, splits, name: str):
        """splits[r] elements of `send` to rank r; returns what every rank sent here, in rank order."""

    @abc.abstractmethod
    def allgather(self, message, name: str):
        """Every rank's message (of equal sizes), concatenated in rank order."""

    def alltoall_each(self, parts: Sequence, splits, name: str, take) -> None:
        """Eager, every rank's `splits` alike, the message `parts` end to end (1-D arrays of one
        dtype, at least one): take(rank, what it sent here) for every rank in rank order.
        Collectives that can write the parts where they are sent and hand each rank's part over
        where it arrived (shared memory) save both copies of a concatenation."""
        for rank, row in enumerate(self.alltoall(_arrays.concatenated(parts), splits, name).reshape(self.world, -1)):
            take(rank, row)

    def allgather_each(self, message, name: str, take) -> None:
        """Eager, messages of equal sizes: take(rank, its message) for every rank in rank order
        (as alltoall_each)."""
        for rank, row in enumerate(self.allgather(message, name).reshape(self.world, -1)):
            take(rank, row)

    def allreduce(self, values, name: str):
        """The sum over the ranks of a float array (the framework's own allreduce: policy="auto")."""
        raise NotImplementedError(f"{type(self).__name__} has no allreduce: policy='auto' needs one")

    def alltoall_start(self, send, splits, name: str):
        """Start an alltoall -> a handle for wait(); by default it runs to the end at once."""
        return self.alltoall(send, splits, name)

    def allgather_start(self, message, name: str):
        return self.allgather(message, name)

    def wait(self, handle):
        """The result of a started collective."""
        return handle


class Eager(Collectives):
    """Collectives for frameworks that run Python as they go: a stage is a plain call."""

    def stage(self, fn, inputs, dtypes):
        return fn(*inputs)


class AsyncEager(Eager):
    """Eager collectives whose alltoall and allgather can start without waiting: subclasses give
    alltoall_start, allgather_start and wait; the blocking forms are a start and a wait."""

    @abc.abstractmethod
    def alltoall_start(self, send, splits, name):
        """-> a handle for wait()."""

    @abc.abstractmethod
    def allgather_start(self, message, name):
        """-> a handle for wait()."""

    @abc.abstractmethod
    def wait(self, handle):
        """The result of a started collective, as the blocking form returns it."""

    def alltoall(self, send, splits, name):
        return self.wait(self.alltoall_start(send, splits, name))

    def allgather(self, message, name):
        return self.wait(self.allgather_start(message, name))


class Subgroup(Collectives):
    """Collectives among `members` (ranks of `whole`, ascending) carried by `whole`'s own
    alltoall: a rank's messages to non-members are empty, so only members' bytes move. What a
    framework without subgroups (Horovod without dynamic process sets) runs two levels on. An
    allgather is an alltoall of the message to every member; every rank of `whole` must call
    each collective, as it calls every other collective of the exchange."""

    equal_allgather = False

    def __init__(self, whole: Collectives, members: Sequence[int]):
        if list(members) != sorted(members):
            raise ValueError(f"a Subgroup's members must be ascending ranks, got {list(members)}")
        self.whole, self.members = whole, tuple(members)
        self.world, self.rank = len(self.members), self.members.index(whole.rank)

    @property
    def eager(self):
        return self.whole.eager

    def stage(self, fn, inputs, dtypes):
        return self.whole.stage(fn, inputs, dtypes)

    def _whole_splits(self, splits):
        full, = self.whole.stage(lambda s: (_spread(s, self.members, self.whole.world),), [splits], [np.int32])
        return full

    def _to_members(self, message):
        """(message repeated once per member, the splits sending one copy to each)."""
        def tile(m):
            xp = _arrays.array_module(m)
            return xp.concatenate([m] * self.world), _spread([m.size] * self.world, self.members, self.whole.world)
        dtype = np.dtype(getattr(message.dtype, "as_numpy_dtype", message.dtype))  # a tf.DType in a graph
        return self.whole.stage(tile, [message], [dtype, np.int32])

    def max_allreduce(self, vector, name):
        send, splits = self._to_members(vector)
        rows = self.whole.alltoall(send, splits, name)
        out, = self.whole.stage(lambda r: (r.reshape(self.world, -1).max(axis=0),), [rows], [np.float64])
        return out

    def alltoall(self, send, splits, name):
        return self.whole.alltoall(send, self._whole_splits(splits), name)

    def allgather(self, message, name):
        return self.whole.alltoall(*self._to_members(message), name)

    def alltoall_start(self, send, splits, name):
        return self.whole.alltoall_start(send, self._whole_splits(splits), name)

    def allgather_start(self, message, name):
        return self.whole.alltoall_start(*self._to_members(message), name)

    def wait(self, handle):
        return self.whole.wait(handle)


def _spread(splits, members, world: int) -> np.ndarray:
    """Per-member splits -> per-rank splits of the whole group (0 for every other rank)."""
    full = np.zeros(world, np.int32)
    full[list(members)] = np.asarray(splits, np.int32)
    return full


@dataclasses.dataclass(frozen=True)
class Levels:
    """The groups one exchange uses: `world` (every rank: the metadata, the native allreduce),
    `cross` (the codes: every rank when flat, the ranks sharing this local rank with two levels)
    and `local` (None when flat: the ranks of this host)."""
    world: Collectives
    cross: Collectives
    local: Optional[Collectives] = None

    @classmethod
    def flat(cls, coll: Collectives) -> "Levels":
        return cls(coll, coll, None)


def run(stages: CodesStages, bucket: Bucket, flat, levels: Levels, out=None, average: bool = False,
        divisor: Optional[int] = None):
    """One bucket's exchange -> the float32 sums across ranks (average=True: divided by N) as one
    flat array, the tensors end to end (NaN-filled where a rank held NaN/Inf). `flat`: this
    rank's gradients end to end (bucket.sizes), one float32 array (a graph tensor in TF graphs);
    `stages`: the CodesStages of the codes group; bucket.name: stable from step to step and
    equal on every rank (collective names, buffer keys, the schedule); `out`: eager callers may
    pass the flat array to write the results into (`flat` itself: in place; each element is
    read before its result is written). divisor: what the sums are divided by, where it is not
    the group's size (FSDP's two levels: every rank's count, the hosts' sums having come from a
    reduce-scatter inside each host)."""
    schedule, coll = stages.schedule, levels.cross
    handed = time.perf_counter()  # the bucket's hand-over to the driver: where its place in the step starts
    if not coll.eager and stages.config.policy is Policy.AUTO:
        _warn_graph_policy()
    candidate = schedule.candidate(bucket.name) if coll.eager else stages.config.graph_chunk_bytes
    divisor = divisor or (levels.world.world if average else 1)
    if candidate == NATIVE:  # policy="auto" chose, or is timing, the framework's own allreduce
        return _native(stages, bucket, flat, levels.world, out, divisor, schedule.native_dtype())
    result = BucketExchange(stages, bucket, flat, levels, out, divisor, candidate).result()
    if coll.eager:
        schedule.ran(bucket.name, candidate)
        if schedule.predicting:  # policy="auto" will predict the framework's step from the model
            ended = time.perf_counter()
            per_host = 1 if levels.local is None else levels.local.world
            schedule.estimate_native(bucket.name, sum(bucket.sizes), levels.world.world // per_host, per_host)
            schedule.placed(bucket.name, handed, ended)
    return result


class BucketExchange(Exchange):
    """One bucket's codes exchange (steps 0-6 of the module docstring), one object: its driver
    (result, pipeline), its stages as methods, the groups and host slices of two levels, and, as
    the Exchange it is, what its stages read and fill from the agreement on. Graph frameworks
    run the stages inside their graph (Collectives.stage), as often as the graph runs; eager
    ones call them once."""

    def __init__(self, stages: CodesStages, bucket: Bucket, flat, levels: Levels, out, divisor: float,
                 candidate: int):
        super().__init__()
        self.stages, self.bucket, self.levels, self.out, self.divisor = stages, bucket, levels, out, divisor
        self.candidate, self.coll, local = candidate, levels.cross, levels.local
        self.cuts = self.slice_message = self.chunked = None
        if local is not None:  # step 0: this local rank's slice of the host's sum
            self.cuts, slices = _layout.slices(bucket.sizes, local.world)
            self.held = bucket.part(slices[local.rank])
            self.data, self.slice_out, self.slice_message = _scatter(bucket, self.cuts, flat, local,
                                                                     stages.state.buffers)
            # every cross group cuts as many chunks (Subgroups of one whole group call its collectives together)
            self.chunked = max(b - a for a, b in zip(self.cuts[:-1], self.cuts[1:]))
        else:
            self.held, self.data, self.slice_out = bucket, flat, out
        self.parts = 1 if local is None else local.world
        self.follow = stages.config.error_feedback and self.coll.eager
        self.prepared = None  # what the metadata stage hands the agreement

    def result(self):
        """The driver: metadata, agreement, the chunks pipelined, the host's gather."""
        world, name, config = self.levels.world, self.bucket.name, self.stages.config
        if self.follow and self.levels.local is not None:  # a host sum's residuals lie with its slice's local rank
            _follow_layout(self.stages.state, self.bucket, SEND, _signature(self.bucket, self.parts), self.levels.local,
                           [(s.tensor, s.start, s.size) for s in self.held.segments])
        vector, = world.stage(self.metadata, [self.data], [np.float64])
        agreed = _read(world.max_allreduce(vector, f"{name}.meta"))
        _check_settings(world, config, agreed, name)
        token, = world.stage(self.agree, [agreed], [np.uint8])
        if self.follow:  # a share's owner residual lies with its owner
            _follow_layout(self.stages.state, self.bucket, OWNER,
                           _signature(self.bucket, self.parts, self.coll.world, self.agreement.lanes_of), world,
                           self.stages.owned(self))
        result = self.pipeline(token)
        if self.levels.local is not None:
            result = _gather(self.bucket, self.cuts, result, self.levels.local, self.out, self.slice_message,
                             self.stages.state.buffers)
        return result

    def chunks(self) -> int:
        if self.coll.eager:
            return self.agreement.count
        elements = self.chunked or sum(s.size for s in self.held.segments)
        return _graph_chunks(elements, self.stages.config.graph_chunk_bytes)

    def pipeline(self, token):
        """Steps 3-5 for every chunk, chunk k encoded while k-1 travels and k-2 is decoded -> the
        held segments' results, one flat array."""
        coll, name, chunks = self.coll, self.bucket.name, self.chunks()
        codes, shards, finished = {}, {}, []
        for c in range(chunks + 2):
            if c < chunks:
                send, splits = coll.stage(functools.partial(self.encode, c), [token, self.data], [np.uint8, np.int32])
                codes[c] = coll.alltoall_start(send, splits, f"{name}.codes{c}")
            if 0 <= c - 1 < chunks:
                message, = coll.stage(functools.partial(self.reduce, c - 1), [coll.wait(codes.pop(c - 1))],
                                      [np.uint8])
                shards[c - 1] = coll.allgather_start(message, f"{name}.shards{c - 1}")
            if c - 2 >= 0:
                finished += coll.stage(functools.partial(self.finish, c - 2), [coll.wait(shards.pop(c - 2))],
                                       [np.uint8])
        result, = coll.stage(self.done, finished, [np.float32])
        return result

    # The stages: host work on arrays, each returning a tuple of arrays ---------------------------------
    def metadata(self, array) -> tuple:
        """Step 1: each tensor's max |g| and size, the signature."""
        vector, self.prepared = self.stages.metadata(self.held, array)
        return (vector,)

    def agree(self, agreed) -> tuple:
        """Step 2: APS shifts and formats agreed, the chunks laid out."""
        xp = _arrays.array_module(self.prepared)  # NumPy for graph tensors: their stages see NumPy
        self.stages.agree(self, self.held, agreed, self.prepared, self.slice_out, divisor=self.divisor, xp=xp,
                          candidate=self.candidate, padded=self.coll.equal_allgather, chunked=self.chunked)
        self.prepared = None
        return (_TOKEN,)

    def encode(self, chunk: int, token, array) -> tuple:
        """Step 3: every owner's part of the chunk encoded -> (message, splits)."""
        send, splits = self.stages.begin(self, chunk)
        return send, np.asarray(splits, np.int32)

    def reduce(self, chunk: int, received) -> tuple:
        """Step 4: this rank's part decoded and summed, re-encoded."""
        return (self.stages.reduce(self, chunk, received),)

    def finish(self, chunk: int, gathered) -> tuple:
        """Step 5: every owner's part decoded into the results."""
        self.stages.finish(self, chunk, gathered)
        return (_TOKEN,)

    def done(self, *finished) -> tuple:
        """After the last chunk: the results."""
        return (self.stages.done(self),)


def _read(agreed):
    """The agreed metadata on the host: where the exchange runs on a device, the one read a
    bucket makes (formats, chunks and checks are the host's; everything after stays there)."""
    return _arrays.to_numpy(agreed) if _arrays.is_array(agreed) else agreed


def _check_settings(coll: Collectives, config, agreed, name: str) -> None:
    """Ranks configured differently, found in the agreed metadata: every rank holds the same
    vector and finds it at once, so every rank gathers every rank's settings (two collectives, on
    this error path only) and raises the same error, naming each field that differs with each
    rank's value. TF's tensors pass here: its stages run in tf.numpy_function, where no
    collective can run, and the agreement's check (hvd_aps._metadata.read) raises instead."""
    if not coll.eager or not _arrays.is_array(agreed) or _metadata.same_settings(
            agreed[-_metadata.TAIL:]):
        return
    mine = _metadata.settings_message(config)
    width = int(_arrays.to_numpy(coll.max_allreduce(np.array([mine.size], np.float64), f"{name}.settings_size"))[0])
    message = np.zeros(width, np.uint8)  # padded to the longest: torch.distributed gathers equal sizes only
    message[:mine.size] = mine
    rows = _arrays.to_numpy(coll.allgather(message, f"{name}.settings")).reshape(coll.world, width)
    raise _metadata.settings_differ(_metadata.settings_of(rows))


@functools.lru_cache(maxsize=None)
def _warn_graph_policy() -> None:
    warnings.warn("hvd_aps: inside a graph (tf.function) the exchange is fixed when traced, so policy='auto' cannot "
                  "switch buckets to the framework's allreduce there: codes are sent (run eagerly to let it choose)",
                  RuntimeWarning, stacklevel=4)


def _signature(bucket: Bucket, *layout) -> str:
    """A name for where a bucket's elements lie among the ranks: equal on every rank and in every
    process that lays the same tensors out alike (kept in the bucket per layout)."""
    def name():
        text = repr((bucket.keys, bucket.sizes, layout)).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()
    return bucket.kept(("signature", layout), name)


def _follow_layout(state, bucket: Bucket, side: str, signature: str, group: Collectives, holdings: list) -> None:
    """Error feedback across layouts: where the bucket's residuals on `side` were committed under
    another layout (DDP rebuilt its buckets, a checkpoint resumed on other buckets, the world
    changed), each moves to the rank that holds its elements now, so no residual is lost or
    applied to other elements. Every element's residual lies on one rank of `group`, zeros on
    the others: a Max-allreduce of the float32 bits as unsigned integers (exact in float64)
    hands each rank the residuals of `holdings`, (tensor, start, size) of what it holds now."""
    if state.residuals.moved(bucket.keys, side, signature):
        offsets = np.cumsum([0] + list(bucket.sizes))
        where = dict(zip(bucket.keys, offsets[:-1]))
        bits = np.zeros(int(offsets[-1]), np.float64)
        for (key, _, start), residual in state.residuals.held(bucket.keys, side).items():
            kept = _arrays.to_numpy(residual).view(np.uint32)[:max(bucket.sizes[bucket.keys.index(key)] - start, 0)]
            bits[where[key] + start:where[key] + start + kept.size] = kept
        agreed = _arrays.to_numpy(group.max_allreduce(bits, f"{bucket.name}.{side}_residuals"))
        state.residuals.moved_in(bucket.keys, side, {
            (bucket.keys[t], side, start): agreed[offsets[t] + start:offsets[t] + start + size].astype(np.uint32).view(
                np.float32) for t, start, size in holdings})
    state.residuals.laid_out(bucket.keys, side, signature)


def reduce_scatter(stages: ScatterStages, name: str, rows, coll: Collectives, out, divisor: float = 1):
    """The codes reduce-scatter (hvd_aps._scatter): rows (world, n) float32, row r for rank r ->
    `out` (n float32), this rank's row summed over the ranks and divided by `divisor`. Eager."""
    vector, rows = stages.metadata(name, rows)
    agreed = _read(coll.max_allreduce(vector, f"{name}.meta"))
    _check_settings(coll, stages.config, agreed, name)
    agreement = stages.agree(name, agreed, rows, divisor)
    send, splits = stages.begin(agreement)
    received = coll.alltoall(send, np.asarray(splits, np.int32), f"{name}.codes")
    return stages.reduce(agreement, received, out)


def _graph_chunks(elements: int, chunk_bytes: int) -> int:
    """A graph's chunk count, fixed when traced: from every element held (a tensor left out for
    NaN leaves its chunks' ranges empty, not fewer chunks)."""
    return max(1, -(-elements // (chunk_bytes // 4))) if chunk_bytes > 0 else 1


def _scatter(bucket: Bucket, cuts: list, flat, local: Collectives, buffers) -> tuple:
    """Two levels, step 0: the flat bucket cut at `cuts` (one slice per local rank, contiguous) ->
    (the host's sum of this local rank's slice, in local-rank order, where its results go and
    (eagerly) the one padded buffer they lie in, which the host's allgather then sends as it is)."""
    lens = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    mine = lens[local.rank]

    def add_row(total, writer, row):  # the host's sum in local-rank order: the same bits every run
        if writer == 0:
            total[...] = row
        else:
            total += row

    def host_sum(xp):
        return buffers.get((bucket.name, "host sum"), mine, np.float32, xp)

    def add(received):
        total = host_sum(_arrays.array_module(received))
        for writer, row in enumerate(received.reshape(local.world, mine)):
            add_row(total, writer, row)
        return (total,)

    splits, name = np.asarray(lens, np.int32), f"{bucket.name}.host_scatter"
    if _arrays.is_array(flat):  # written from the bucket, summed from where it arrived
        total = host_sum(_arrays.array_module(flat))
        parts = [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        local.alltoall_each(parts, splits, name, lambda writer, row: add_row(total, writer, row))
    else:  # TensorFlow's tensors: the bucket is the message already, its slices in local-rank order
        total, = local.stage(add, [local.alltoall(flat, splits, name)], [np.float32])
    if not local.eager:
        return total, None, None
    xp = _arrays.array_module(flat)
    message = buffers.get((bucket.name, "host slice"), max(lens), np.float32, xp)
    message[mine:] = 0  # equal sizes, as torch.distributed's all_gather needs
    return total, message[:mine], message


def _gather(bucket: Bucket, cuts: list, result, local: Collectives, out, message, buffers):
    """Two levels, step 6: every local rank's result slice into one flat (`out`, else the result
    array `buffers` keeps). `message`: the padded buffer the results lie in (eager), else they
    are padded into one here."""
    lens = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    longest = max(lens)

    def pack(result):
        if message is not None:
            return (message,)
        xp = _arrays.array_module(result)
        packed = xp.zeros(longest, xp.float32)  # equal sizes, as torch.distributed's all_gather needs
        packed[:result.size] = result
        return (packed,)

    def fresh(xp):
        return out if out is not None else buffers.result((bucket.name, "gathered"), cuts[-1], xp)

    def place(whole, j, row):
        whole[cuts[j]:cuts[j + 1]] = row[:lens[j]]

    def unpack(gathered):
        whole = fresh(_arrays.array_module(gathered))
        for j, row in enumerate(gathered.reshape(local.world, longest)):
            place(whole, j, row)
        return (whole,)

    sent, = local.stage(pack, [result], [np.float32])
    name = f"{bucket.name}.host_gather"
    if not _arrays.is_array(sent):  # TensorFlow's tensors
        whole, = local.stage(unpack, [local.allgather(sent, name)], [np.float32])
        return whole
    whole = fresh(_arrays.array_module(sent))  # each slice copied once, from where it arrived
    local.allgather_each(sent, name, lambda j, row: place(whole, j, row))
    return whole


def _native(stages: CodesStages, bucket: Bucket, flat, world: Collectives, out, divisor: int, path: Path):
    """policy="auto" where codes do not pay: the framework's own allreduce of the bucket on the
    native `path`, counted in the stats and the bytes. The casts run as stages, so the arrays are
    NumPy or CuPy there even where the framework's are tensors (TensorFlow)."""
    dtype = np.dtype(path.value)

    def cast(array):
        return (array.astype(dtype),)

    def back(total):
        xp = _arrays.array_module(total)
        result = out if out is not None else xp.empty(total.size, xp.float32)
        result[...] = total.astype(np.float32)
        if divisor != 1:
            result /= np.float32(divisor)
        return (result,)

    wire, = world.stage(cast, [flat], [dtype])
    total = world.allreduce(wire, f"{bucket.name}.native")
    result, = world.stage(back, [total], [np.float32])
    count_native(stages.stats, stages.state, bucket.keys, zip(bucket.labels, bucket.sizes), path, world.world)
    return result


class Native(enum.Enum):
    """The framework's own collective, by the passes over its data a rank sends in a ring."""
    ALLREDUCE = 2       # a reduce-scatter, then an allgather
    REDUCE_SCATTER = 1  # FSDP2's


def native_bytes(path: Path, elements: int, world: int, collective: Native = Native.ALLREDUCE) -> float:
    """What one rank sends in the framework's ring `collective` of `elements` on the native `path`
    over `world` ranks: (N - 1) / N of the data a pass."""
    return collective.value * (world - 1) / world * path.itemsize * elements


def count_native(stats, state, keys, labelled_sizes, path: Path, world: int,
                 collective: Native = Native.ALLREDUCE) -> None:
    """A native exchange (the framework's own collective where policy="auto" chose it) counted as
    a codes exchange is, wherever it is sent: every tensor as passed through on `path`, the bytes
    a rank sent (native_bytes), and the tensors' step done."""
    labelled_sizes = list(labelled_sizes)
    for label, n in labelled_sizes:
        stats.passed_through(label, n, path)
    stats.record_sent(int(native_bytes(path, sum(n for _, n in labelled_sizes), world, collective)))
    state.exchanged(keys)


_TOKEN = np.zeros(0, np.uint8)  # what ordering-only stages return: graph stages run in data order
