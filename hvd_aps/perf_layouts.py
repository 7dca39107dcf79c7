"""Step models of the layouts beside data parallelism, on hvd_aps.perf's terms (Link, Cluster,
Codec, Path and its alpha-beta collectives); each returns seconds a step and the bytes it sends.

- A pipeline (one stage a host, 1F1B): microbatches + stages - 1 slots, each a round trip over the
  stages (a micro-batch's compute and its hops, shared by the stages' micro-batches in flight);
  codes cost a pass at each end of a message (BlockCodes).
- Tensor-parallel layers: a step's activation collectives (all-gathers, reduce-scatters, sums),
  each waited for where the next layer needs it, as on the CPU; the framework's in the path's bits,
  or codes (the bucket exchange, its scatter half, BlockCodes gathers).
- DiLoCo: inner steps alone, then every fragment's outer exchange, of which only what runs past
  its `delay` inner steps shows (and, on a processor shared with compute, its processor time).
"""
import dataclasses
import enum
from typing import Sequence

from . import perf
from ._diloco_schedule import Schedule
from .perf import BITS_PER_BYTE, Cluster, Path, Workload

# a stage's codec passes a micro-batch: it encodes what it sends and decodes what it receives,
# each way (a middle stage; an end stage sends and receives one way)
MIDDLE_STAGE_PASSES, END_STAGE_PASSES = 4, 2


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One step of a pipeline: `stages` stages (one a host of the cluster), `microbatches` a step,
    `activations` values a micro-batch sends across a boundary each way (its micro-batch's
    sequences x length x width), `compute` seconds of one stage's forward and backward of the
    whole step (the slowest stage's), `optimizer` seconds after."""
    stages: int
    microbatches: int
    activations: int
    compute: float
    optimizer: float = 0.0

    def __post_init__(self):
        if self.stages < 2 or self.microbatches < 1 or self.activations < 1 or min(self.compute, self.optimizer) < 0:
            raise ValueError(f"a pipeline needs 2 or more stages, 1 or more micro-batches and activations, compute "
                             f"and optimizer >= 0: {self}")


def _message(elements: float, path: Path) -> float:
    """Bytes of one message of `elements` values on `path` (codes: BlockCodes' exponents too)."""
    return perf.codes_bytes(elements, path.bits) if path.codes else elements * path.bits / BITS_PER_BYTE


def _hop(nbytes: float, c: Cluster) -> float:
    """Seconds of one message of `nbytes` between two hosts."""
    return c.between.latency + nbytes / c.between.bandwidth


def _passes(path: Path, c: Cluster, elements: float, passes: float) -> float:
    """Seconds of `passes` codec passes over `elements` values, as a share of the calibrated
    bucket exchange's 3 + 1/N passes over as many (0 for the framework's own messages)."""
    if not path.codes:
        return 0.0
    return perf.passes_share(passes, c.world) * perf.shared_codec(path.codec, c).time(elements)


def pipeline_step(p: Pipeline, path: Path, c: Cluster) -> tuple:
    """(seconds a step, bytes crossing each boundary each way a step) of `p` on `path`, its stages
    one a host of `c`. A micro-batch's round trip is its forward through every stage and its
    backward back, a hop each way a boundary; 1F1B keeps at most `stages` micro-batches in flight,
    so a step is microbatches + stages - 1 slots of a round trip over the stages (the link's own
    time for a message never exceeds a slot: a round trip crosses it twice a boundary)."""
    if c.hosts != p.stages:
        raise ValueError(f"the pipeline's {p.stages} stages stand one a host: the cluster has {c.hosts}")
    message = _message(p.activations, path)
    passes = END_STAGE_PASSES if p.stages == 2 else MIDDLE_STAGE_PASSES
    microbatch = p.compute / p.microbatches + _passes(path, c, p.activations, passes)
    slot = microbatch + 2 * (p.stages - 1) / p.stages * _hop(message, c)
    return (p.microbatches + p.stages - 1) * slot + p.optimizer, p.microbatches * message


class Collective(enum.Enum):
    """An activation collective of a tensor-parallel layer (hvd_aps.tensor_parallel's table)."""
    ALL_GATHER = "all-gather"          # a sequence-sharded input gathered, a replicated output's slices
    REDUCE_SCATTER = "reduce-scatter"  # partial outputs summed into sequence shards
    ALL_REDUCE = "sum"                 # partial outputs summed, replicated


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One step of tensor-parallel layers over the cluster's ranks: `collectives` the step's
    (Collective, values of the whole tensor) forward and backward, `compute` one rank's forward
    and backward (its shard's), `optimizer` seconds after; `float32` collectives that stay in
    float32 whatever the path (the ones no style replaces, e.g. an embedding output's gradient);
    `per_collective` seconds each collective costs the step beyond its link's latency (DTensor's
    redistribution, the autograd Function, the framework's call: fitted on a float32 step)."""
    collectives: Sequence[tuple]
    compute: float
    optimizer: float = 0.0
    float32: Sequence[tuple] = ()
    per_collective: float = 0.0

    def __post_init__(self):
        if not self.collectives or min(self.compute, self.optimizer, self.per_collective) < 0 or any(
                n < 1 for _, n in (*self.collectives, *self.float32)):
            raise ValueError(f"tensor-parallel layers need collectives of 1 or more values, compute, optimizer and "
                             f"per_collective >= 0: {self}")

    @classmethod
    def sequence_parallel(cls, blocks: int, activations: int, compute: float, projections: int = 3,
                          optimizer: float = 0.0, per_collective: float = 0.0) -> "TensorParallel":
        """Transformer blocks under sequence parallelism (hvd_aps.tensor_parallel's styles): each
        column-parallel layer (`projections` for attention's inputs, 3 where q, k and v gather
        apart, 1 where one gather serves them as torchtitan's PrepareModuleInput does; the MLP's
        up) gathers the sequence forward and reduce-scatters its input's gradient backward, each
        row-parallel one (attention's output, the MLP's down) the other way round: `activations`
        values each (a step's sequences x length x width)."""
        if blocks < 1 or projections < 1:
            raise ValueError(f"sequence parallelism needs 1 or more blocks and projections, got {blocks}, "
                             f"{projections}")
        layers = projections + 1 + 2
        per_block = [(kind, activations) for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
                     for _ in range(layers)]
        return cls(tuple(per_block * blocks), compute, optimizer, per_collective=per_collective)


def _native(kind: Collective, elements: float, bits: int, c: Cluster, gloo: bool) -> float:
    """Seconds on the links of the framework's collective of `elements` `bits`-bit values."""
    nbytes = elements * bits / BITS_PER_BYTE
    if kind is Collective.ALL_GATHER:
        return perf.allgather(nbytes / c.world, c)
    if kind is Collective.REDUCE_SCATTER:
        return perf.native_reduce_scatter(nbytes, c, gloo)
    return perf.allreduce(nbytes, c)


def _native_bytes(kind: Collective, elements: float, bits: int, world: int, gloo: bool) -> float:
    """Bytes a rank sends in the framework's collective: a ring's (N-1)/N of the tensor an
    all-gather, 2(N-1)/N an allreduce (and Gloo's reduce-scatter)."""
    share = 2 if kind is Collective.ALL_REDUCE or (kind is Collective.REDUCE_SCATTER and gloo) else 1
    return share * (world - 1) / world * elements * bits / BITS_PER_BYTE


def _coded(kind: Collective, elements: float, path: Path, c: Cluster) -> tuple:
    """(seconds on the links, seconds of codec, bytes a rank sends) of one codes collective: an
    all-gather as BlockCodes, a reduce-scatter as the exchange's scatter half, a sum as the whole
    bucket exchange."""
    codes = perf.codes_bytes(elements, path.bits)
    share = (c.world - 1) / c.world * codes
    if kind is Collective.ALL_GATHER:
        return (*perf.codes_all_gather(elements, path, c), share)
    scatter, codec = perf.codes_reduce_scatter(elements, path, c)
    if kind is Collective.REDUCE_SCATTER:
        return scatter, codec, share
    # a sum, flat: the scatter half, then the allgather of the re-encoded sums
    return scatter + perf.allgather(codes / c.world, c), perf.shared_codec(path.codec, c).time(elements), 2 * share


def tensor_parallel_step(t: TensorParallel, path: Path, c: Cluster, gloo: bool = True) -> tuple:
    """(seconds a step, bytes a rank sends a step) of `t` on `path` over `c`'s ranks (`gloo`: the
    framework's reduce-scatter moves an allreduce's bytes, as torch's Gloo backend does)."""
    seconds = t.compute + t.optimizer + t.per_collective * (len(t.collectives) + len(t.float32))
    sent = 0.0
    for kind, n in t.float32:
        seconds += _native(kind, n, 32, c, gloo)
        sent += _native_bytes(kind, n, 32, c.world, gloo)
    for kind, n in t.collectives:
        if path.codes:
            wire, codec, nbytes = _coded(kind, n, path, c)
        else:
            wire, codec = _native(kind, n, path.bits, c, gloo), perf.processor_time(n, path, c)
            nbytes = _native_bytes(kind, n, path.bits, c.world, gloo)
        seconds, sent = seconds + wire + codec, sent + nbytes
    return seconds, sent


def diloco_step(w: Workload, schedule: Schedule, path: Path, c: Cluster) -> tuple:
    """(seconds an inner step on average, bytes a rank sends an inner step) of `w`'s inner steps
    with DiLoCo's outer exchange on `path` (hvd_aps.diloco's Schedule: one fragment's exchange at
    a time): every sync_every steps each fragment's exchange (perf.exchange_time of its share of
    the parameters, flat) shows beyond the `delay` inner steps it runs beside, and where compute
    shares the processor, its processor time at the cluster's contention in any case."""
    inner = w.compute + w.optimizer
    fragment = w.parameters / schedule.fragments
    took = perf.exchange_time(fragment, path, c)
    busy = c.contention * perf.busy_time(fragment, 1, path, c) if w.shared_processor else 0.0
    shows = took if schedule.delay == 0 else max(took - schedule.delay * inner, busy)
    sent = schedule.fragments * exchange_bytes(fragment, path, c.world) / schedule.sync_every
    return inner + schedule.fragments * shows / schedule.sync_every, sent


def exchange_bytes(elements: float, path: Path, world: int) -> float:
    """Bytes a rank sends in one flat exchange of `elements` values (two levels send less across
    hosts): a ring allreduce's 2(N-1)/N of them, or the codes exchange's alltoall and allgather
    of as many codes."""
    message = _message(elements, path)
    return 2 * (world - 1) / world * message
