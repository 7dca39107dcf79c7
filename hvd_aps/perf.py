"""A model of one data-parallel training step: how long it takes with each way of exchanging the
gradients (the framework's float32 or 16-bit allreduce, or hvd_aps's codes, flat or on two
levels), on a cluster described by a few numbers, before anything is sent (docs/performance-model.md).

Pure functions over small frozen values, no framework imports (`python -m hvd_aps plan` prints them;
`calibrate` fits `Codec`). Collectives are alpha-beta, as NCCL's tuner counts them, a host's ranks
sharing its link. The codes exchange: a Max-allreduce, an alltoall, an allgather and its processor
time (`Codec.fixed + Codec.per_element * n`), chunked as the schedule would. Two levels: float32
inside a host (on the CPU, shared-memory copies: `Cluster.host_copies`), codes between hosts. A
16-bit allreduce on the CPU adds a fitted processor cost an element (`_ring_with_sums`). The step is
a timeline (`_Timeline`): forward, backward handing gradients to exchanges (`Workload.timeline`)
that start when their bucket and the one before are done (sharing the CPU with compute), optimizer.
Left out: two exchanges in flight at once, Horovod's cycle time, stragglers, congestion.
"""
import dataclasses
import enum
import itertools
import math
import re
from typing import Callable, Optional, Sequence

from ._choice import Choice
from .config import DEFAULT_BUCKET_BYTES

FLOAT32_BYTES = 4
BITS_PER_BYTE = 8
EXPONENT_BYTES_PER_BLOCK = 2 / 2048  # the sums' re-encode exponents: 2 bytes per 2048 codes (hvd_aps._layout)
DDP_FIRST_BUCKET_BYTES = 1 << 20      # torch DDP: the first bucket (the last layers) is capped at 1 MiB,
DDP_BUCKET_BYTES = 25 << 20           # the others at bucket_cap_mb=25
CHUNK_CHOICES = (0, 4 << 20, 1 << 20)  # float32 bytes per chunk the schedule tries (0: unchunked)
# Gloo's ring allreduce (gloo/allreduce.cc) cuts the buffer into segments of at most 1 MiB, at least two
# a rank, and sums one while the next two travel
GLOO_SEGMENT_BYTES = 1 << 20
LOOPBACK = (10e9, 20e-6)              # a host's own memory and loopback, bytes/s and s: where nothing was measured
# float32 passes a rank's processor makes per element of its bucket on two levels through host
# memory (hvd_aps.exchange._scatter/_gather over hvd_aps._host_memory): write the box from the
# gradients, sum the host's parts as they are read from the boxes, read every slice of the results
# into the gradients; plus writing the result of its own slice (the 1 / L in processor_time). (6
# until the reads went straight from the boxes, 4 until a batch whose tensors do not lie end to end
# was written into the box without being concatenated first.)
HOST_COPIES = 3
DEFAULT_LATENCY = 50e-6               # between hosts, where nothing was measured (Ethernet with TCP)
# What each collective of Horovod's costs beyond its link's latency: its background thread
# negotiates every collective (rank 0 gathers the ranks' requests, then answers), which its
# timeline showed at 3-5 ms an alltoall or allgather on the netns cluster; 2 ms fitted on that
# cluster's uncapped Horovod codes rows (examples/perf_model_check.py, 2026-11-26)
HOROVOD_COLLECTIVE_S = 2e-3
HOROVOD_FUSION_BYTES = 128 << 20  # Horovod's tensor fusion threshold (HOROVOD_FUSION_THRESHOLD's default)
# bits a second as tc names them (1gbit, 10Gbit/s), or bytes (12.5GB, 12.5GB/s); "bps" is left
# out: tc reads it as bytes, a NIC's data sheet as bits
_RATE = re.compile(r"^\s*([0-9.]+)\s*([kKmMgGtT]?)(bit|Bit|B)(?:/s)?\s*$")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclasses.dataclass(frozen=True)
class Link:
    """A link class: bytes a second, and seconds per message step (alpha)."""
    bandwidth: float
    latency: float = DEFAULT_LATENCY

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self}")

    @classmethod
    def parse(cls, rate: str, latency: float = DEFAULT_LATENCY) -> "Link":
        """'1gbit', '10Gbit/s' (bits a second), or '12.5GB', '12.5GB/s' (bytes a second)."""
        m = _RATE.match(rate)
        if not m:
            raise ValueError(f"a link rate is a number and a unit like 1gbit, 10Gbit/s or 12.5GB/s, got {rate!r}")
        value = float(m.group(1)) * _SCALE[m.group(2).lower()]
        return cls(value if m.group(3) == "B" else value / BITS_PER_BYTE, latency)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """hosts x ranks_per_host ranks; `between` links the hosts, `inside` the ranks of a host;
    `hierarchical`: codes go on two levels where hosts hold several ranks (else one flat exchange);
    `sharing`: how many ranks share the processor cores the codec's calibration had to itself
    (the ranks of a host on a CPU cluster; every rank where a test cluster runs on one machine):
    the codec takes that many times its calibrated time; `tree`: the framework's allreduce takes
    the faster of a ring and a double binary tree (NCCL does, Gloo's ring does not), whose
    latency grows with log2 of the ranks, not with the ranks; `copy`: seconds per float32 element
    the host's processor copies through its memory (`python -m hvd_aps calibrate`, every core at
    once, so scaled by `sharing` as the codec is): where > 0, two levels run their host level
    through that memory on the processor (hvd_aps on the CPU), where 0 over the `inside` link;
    `host_copies`: the float32 passes that host level makes per element of a rank's bucket
    (HOST_COPIES: hvd_aps's now; earlier trees made more, and the model's check counts theirs);
    `contention`: where compute and the exchange share the processor (Workload.shared_processor),
    the share of the processor compute loses while the exchange's codec and passes run beside it
    (1: all of it, the cores being all compute's; less where the exchange's threads find idle
    cores), per second of their processor time; `wire_contention`: the same per second on the
    links (0 where a NIC moves the bytes; over TCP the kernel copies them on the cores compute
    runs on). `python -m hvd_aps calibrate --links --entry-points` measures both in a job."""
    hosts: int
    between: Link
    ranks_per_host: int = 1
    inside: Link = Link(*LOOPBACK)
    hierarchical: bool = True
    sharing: float = 1.0
    tree: bool = False
    copy: float = 0.0
    host_copies: float = HOST_COPIES
    contention: float = 1.0
    wire_contention: float = 0.0

    def __post_init__(self):
        if (self.hosts < 1 or self.ranks_per_host < 1 or self.sharing < 1
                or min(self.copy, self.host_copies, self.contention, self.wire_contention) < 0):
            raise ValueError(f"a cluster needs hosts and ranks_per_host >= 1, sharing >= 1, copy, host_copies and "
                             f"contentions >= 0, got {self}")

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def two_levels(self) -> bool:
        return self.hierarchical and self.hosts > 1 and self.ranks_per_host > 1


@dataclasses.dataclass(frozen=True)
class Codec:
    """The codes exchange's own time on one rank for a bucket of n float32 (everything but the
    wire: encode, decode-and-sum, re-encode, decode, the stats, the driver), fitted on the real
    driver by `python -m hvd_aps calibrate`: a cost per exchange, per tensor and per element;
    `device`: its passes run on an accelerator (see busy())."""
    fixed: float
    per_element: float
    per_tensor: float = 0.0
    device: bool = False

    def time(self, elements: float, tensors: float = 1) -> float:
        return self.fixed + self.per_tensor * tensors + self.per_element * elements

    def busy(self, elements: float, tensors: float = 1) -> float:
        """The part of time() that takes the processor computing the step: all of it for a host
        codec; for a `device` codec (a GPU's kernels) its passes over the elements only, the
        costs per exchange and per tensor being its driver's, on the host."""
        return self.per_element * elements if self.device else self.time(elements, tensors)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One rank's step: `parameters` float32 gradients; `compute` seconds of forward and backward,
    `backward` the share of it that is backward; `optimizer` seconds after the exchange;
    `buckets` their sizes in elements in the order they become ready (default: DDP's);
    `tensors` how many gradient tensors there are (default: one a bucket), spread over the
    buckets by size; `timeline`: each gradient tensor's (elements, fraction of the backward
    after which it is ready) in the order backward produces them, as a profile measured them
    (default: in proportion to their elements); `shared_processor`: the codec runs on the
    processor that computes (training on the CPU)."""
    parameters: int
    compute: float
    backward: float = 2 / 3
    optimizer: float = 0.0
    buckets: Optional[Sequence[int]] = None
    tensors: Optional[int] = None
    timeline: Optional[Sequence[tuple]] = None
    shared_processor: bool = True

    def __post_init__(self):
        if (self.parameters < 1 or self.compute < 0 or not 0 <= self.backward <= 1 or self.optimizer < 0
                or self.tensors is not None and self.tensors < 1):
            raise ValueError(f"a workload needs parameters >= 1, compute and optimizer >= 0, 0 <= backward <= 1 "
                             f"and tensors (where given) >= 1: {self}")
        if self.buckets is not None and sum(self.buckets) != self.parameters:
            raise ValueError(f"buckets hold {sum(self.buckets)} elements, not the {self.parameters} parameters")
        if self.timeline is not None and (sum(n for n, _ in self.timeline) != self.parameters or any(
                not 0 <= a <= b <= 1 for (_, a), (_, b) in zip(self.timeline, [*self.timeline[1:], (0, 1)]))):
            raise ValueError(f"a timeline holds the {self.parameters} parameters, each tensor ready at a fraction "
                             f"of the backward between 0 and 1, in order: {self.timeline}")

    def bucket_sizes(self) -> list:
        if self.buckets is not None:
            return list(self.buckets)
        return ddp_buckets(self.parameters)

    def ready(self, elements: int) -> float:
        """The fraction of the backward after which its first `elements` gradients are ready."""
        if self.timeline is None:
            return elements / self.parameters
        done = 0
        for n, at in self.timeline:
            done += n
            if done >= elements:
                return at
        return 1.0

    def tensors_in(self, elements: int) -> float:
        """Gradient tensors in a bucket of `elements` (at least one)."""
        return 1.0 if self.tensors is None else max(1.0, self.tensors * elements / self.parameters)

    def tensors_before(self, elements: int) -> float:
        """Gradient tensors that start within the first `elements` backward produces (the
        timeline's; else `tensors` equal ones; else one a bucket)."""
        if self.timeline is not None:
            starts = itertools.accumulate((n for n, _ in self.timeline), initial=0)
        elif self.tensors is not None:
            return math.ceil(self.tensors * elements / self.parameters - 1e-9)
        else:
            starts = itertools.accumulate(self.bucket_sizes(), initial=0)
        return sum(1 for start in starts if start < elements)

    @property
    def tensor_count(self) -> int:
        """Gradient tensors of the step: the timeline's, else `tensors`, else one a bucket."""
        if self.timeline is not None:
            return len(self.timeline)
        return self.tensors if self.tensors is not None else len(self.bucket_sizes())

    def gradients(self) -> list:
        """Each gradient tensor's (elements, fraction of the backward after which it is ready), in
        the order backward produces them: the timeline, else tensor_count equal tensors ready in
        proportion to their elements."""
        if self.timeline is not None:
            return list(self.timeline)
        count = self.tensor_count
        sizes = [self.parameters // count + (k < self.parameters % count) for k in range(count)]
        return [(n, done / self.parameters) for n, done in zip(sizes, itertools.accumulate(sizes))]


def entry_buckets(parameters: int, entry: "EntryPoint") -> list:
    """The buckets of an entry point's codes exchange: DDP's, or APSCompressor's (bucket_bytes)
    through Horovod's optimizer or hvd_aps.torch's."""
    if entry is EntryPoint.DDP:
        return ddp_buckets(parameters)
    cap = DEFAULT_BUCKET_BYTES // FLOAT32_BYTES
    return [min(cap, parameters - start) for start in range(0, parameters, cap)]


def ddp_buckets(parameters: int, first_bytes: int = DDP_FIRST_BUCKET_BYTES, bytes_: int = DDP_BUCKET_BYTES) -> list:
    """DDP's bucket sizes in elements for float32 gradients, in the order they are ready (layers
    cut where they fall aside: the model knows sizes, not tensors)."""
    sizes, left, cap = [], parameters, first_bytes // FLOAT32_BYTES
    while left > 0:
        sizes.append(min(left, cap))
        left -= sizes[-1]
        cap = bytes_ // FLOAT32_BYTES
    return sizes


@dataclasses.dataclass(frozen=True)
class Path:
    """A way to exchange a bucket: the framework's allreduce of `bits`-bit values, or hvd_aps's
    codes of a `bits`-bit format (codec: its calibrated time). `processor`: seconds the
    framework's allreduce spends on the processor per element its ring reduces ((N-1)/N of the
    bucket a rank: a 16-bit allreduce's casts and sums on the CPU), or on a bucket exchange of
    codes per element its codec handles beyond (below zero: short of) the codec's calibrated time
    (what the same passes cost inside a job that calibrating alone did not see: the collectives'
    own work, threads contending with compute's, a calibration taken on a slower day), scaled by
    the cluster's `sharing`. FSDP2's codes paths take the codec's time alone. `pipelined`: a
    bucket's chunks overlap one's codec with another's wire (torch.distributed's collectives);
    False where they add up, as measured on Horovod's, whose one background thread runs a
    collective at a time while the codec stages between them leave the wire idle (the timeline
    in docs/benchmarks.md; the model's check: docs/performance-model.md). `collective`: seconds
    each of a codes exchange's collectives costs beyond its link's latency (Horovod's:
    HOROVOD_COLLECTIVE_S, the negotiation its background thread runs for each). `per_gradient`:
    seconds of the processor computing the step that each gradient tensor costs its entry point
    (a hook, an enqueue, Horovod's negotiation of its name, the compressor's own work a tensor),
    as `python -m hvd_aps calibrate --links --entry-points` measures it inside a job. `fusion_bytes`: the
    framework's allreduce fuses gradients as Horovod does (tensor fusion): whenever its
    background thread is free it takes every gradient ready by then, up to this many bytes,
    instead of buckets fixed in advance (0: Workload's buckets)."""
    name: str
    bits: int
    codec: Optional[Codec] = None
    processor: float = 0.0
    pipelined: bool = True
    collective: float = 0.0
    per_gradient: float = 0.0
    fusion_bytes: int = 0

    @property
    def codes(self) -> bool:
        return self.codec is not None


class NativePath(Choice):
    """The framework's allreduce, as plan and the calibration name it (codes paths: codes_path)."""
    FLOAT32 = "float32"
    HALF = "16-bit"


FLOAT32_PATH, HALF_PATH = NativePath.FLOAT32, NativePath.HALF


def codes_path(fmt: str) -> str:
    """The codes path of a format, as plan and the calibration name it."""
    return f"codes {fmt}"


class EntryPoint(str, enum.Enum):
    """Where a training script hands its gradients over, each with its own costs in a job."""
    HOROVOD = "horovod"  # horovod.torch.DistributedOptimizer: Horovod's allreduce (fused), its fp16, the one line
    CODES = "codes"      # hvd_aps.torch.DistributedOptimizer
    DDP = "ddp"          # torch DDP: its allreduce, fp16_compress_hook, hvd_aps.ddp.aps_hook

    @property
    def native(self) -> "EntryPoint":
        """Where the framework's own allreduce it is weighed against runs (the codes optimizer's:
        Horovod's optimizer)."""
        return EntryPoint.HOROVOD if self is EntryPoint.CODES else self


@dataclasses.dataclass(frozen=True)
class EntryCost:
    """What a path through an entry point costs in a job beyond what the model computes from the
    link and the codec (`python -m hvd_aps calibrate --links --entry-points`): seconds a gradient tensor
    (Path.per_gradient) and a cost per element (Path.processor)."""
    per_gradient: float = 0.0
    processor: float = 0.0


def entry_path(name: str, bits: int, codec: Optional[Codec] = None, entry: Optional[EntryPoint] = None,
               cost: EntryCost = EntryCost()) -> Path:
    """A path as `entry` runs it (None: no entry point's own costs, torch.distributed's
    collectives): through Horovod (its optimizer or hvd_aps.torch's) codes run one collective at
    a time at Horovod's cost a collective, and Horovod's own allreduce fuses gradients."""
    horovod = entry in (EntryPoint.HOROVOD, EntryPoint.CODES)
    return Path(name, bits, codec, cost.processor, pipelined=not horovod,
                collective=HOROVOD_COLLECTIVE_S if horovod and codec else 0.0, per_gradient=cost.per_gradient,
                fusion_bytes=HOROVOD_FUSION_BYTES if entry is EntryPoint.HOROVOD and codec is None else 0)


# collectives ------------------------------------------------------------------------------------
def allreduce(nbytes: float, c: Cluster) -> float:
    """The framework's allreduce: a ring of 2(N-1) steps, or where `c.tree` the faster of that and
    a double binary tree of 2 log2 N steps (its bandwidth term taken as the ring's: NCCL's tuner
    rates them alike for large messages)."""
    n = c.world
    if n == 1:
        return 0.0
    link = c.between if c.hosts > 1 else c.inside
    steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n))) if c.tree else 2 * (n - 1)
    return steps * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def alltoall(nbytes: float, c: Cluster) -> float:
    """Each rank sends (n-1)/n of its `nbytes` message; the ranks of a host share its link."""
    n, per_host = c.world, c.ranks_per_host
    if n == 1:
        return 0.0
    if c.hosts == 1:
        return (n - 1) * c.inside.latency + (n - 1) / n * nbytes / c.inside.bandwidth
    return (n - 1) * c.between.latency + per_host * (n - per_host) / n * nbytes / c.between.bandwidth


def allgather(message: float, c: Cluster) -> float:
    """Every rank's `message` bytes to every rank: an alltoall of n copies."""
    return alltoall(message * c.world, c)


# one bucket -------------------------------------------------------------------------------------
def codes_bytes(elements: float, bits: int) -> float:
    return elements * (bits / BITS_PER_BYTE + EXPONENT_BYTES_PER_BLOCK)


def exchange_time(elements: int, path: Path, c: Cluster, tensors: float = 1) -> float:
    """Seconds from a bucket's start to its averaged gradients, codec and processor passes included."""
    if not path.codes:
        return _ring_with_sums(elements * path.bits / BITS_PER_BYTE, processor_time(elements, path, c), c)
    host, between = _codes_wire(elements, path.bits, c)
    return (host + processor_time(elements, path, c)
            + _overlapped(shared_codec(path.codec, c), _codes_elements(elements, c), tensors, between, path))


def _ring_with_sums(nbytes: float, sums: float, c: Cluster) -> float:
    """The framework's ring allreduce of `nbytes` whose sums take `sums` seconds of processor:
    its reduce-scatter half sums a segment while the next ones travel, so the longer of the two
    shows plus one segment's share of the other; its allgather half sums nothing. On this
    project's cluster rows, adding the sums after the wire put torch's 16-bit hook 15 % high at
    1 Gbit/s and ordered 89 % of the pairs; overlapped, 91 % (docs/performance-model.md)."""
    half = allreduce(nbytes, c) / 2
    segments = max(math.ceil(nbytes / GLOO_SEGMENT_BYTES), 2 * c.world)
    return half + max(half, sums) + min(half, sums) / segments


def processor_time(elements: int, path: Path, c: Cluster) -> float:
    """Seconds a rank's processor spends on a bucket's exchange outside the codec's calibrated
    time: a framework allreduce's own passes or the codes path's in the job (`path.processor`),
    and the host level of two levels through host memory (`c.copy`)."""
    if not path.codes:
        return path.processor * (c.world - 1) / c.world * elements * c.sharing
    job = path.processor * _codes_elements(elements, c) * c.sharing
    if not (c.two_levels and c.copy):
        return job
    return job + (c.host_copies + 1 / c.ranks_per_host) * elements * c.copy * c.sharing


def wire_time(elements: int, path: Path, c: Cluster) -> float:
    """Seconds a bucket's exchange spends on the links, its codec left out."""
    if not path.codes:
        return allreduce(elements * path.bits / BITS_PER_BYTE, c)
    return sum(_codes_wire(elements, path.bits, c))


def _codes_elements(elements: int, c: Cluster) -> float:
    """The elements a rank's codec works on: the bucket, or with two levels its slice of it."""
    return elements / c.ranks_per_host if c.two_levels else elements


def _codes_wire(elements: int, bits: int, c: Cluster) -> tuple:
    """(seconds inside the host, seconds of the codes exchange): flat, the metadata, the codes'
    alltoall and the sums' allgather among every rank; on two levels float32 scattered and
    gathered inside the host around the codes exchange of each rank's slice between hosts, the
    L ranks of a host running theirs at once through its link."""
    if not c.two_levels:
        codes = codes_bytes(elements, bits)
        return 0.0, metadata_allreduce(c) + alltoall(codes, c) + allgather(codes / c.world, c)
    local, cross = _levels(c)
    codes = codes_bytes(elements, bits)  # every slice of the host's ranks together
    if c.copy:  # through host memory: its latencies here, its copies in processor_time
        host = 2 * (c.ranks_per_host - 1) * c.inside.latency
    else:
        host = 2 * alltoall(elements * FLOAT32_BYTES, local)
    return host, metadata_allreduce(c) + alltoall(codes, cross) + allgather(codes / c.hosts, cross)


def _levels(c: Cluster) -> tuple:
    """(one host's ranks over its `inside` link, one rank a host over the link between hosts):
    the two levels of a cluster of several ranks a host."""
    return (Cluster(1, c.inside, c.ranks_per_host, c.inside, tree=c.tree),
            Cluster(c.hosts, c.between, 1, c.inside, tree=c.tree))


def shared_codec(codec: Codec, c: Cluster) -> Codec:
    """The codec as it runs on `c`: its calibrated times `c.sharing` times longer."""
    return dataclasses.replace(codec, fixed=codec.fixed * c.sharing, per_element=codec.per_element * c.sharing,
                               per_tensor=codec.per_tensor * c.sharing)


def metadata_allreduce(c: Cluster) -> float:
    """The Max-allreduce of a few floats: latency only."""
    return allreduce(0, c)


def _overlapped(codec: Codec, elements: float, tensors: float, wire: float, path: Path) -> float:
    """Codec and wire of one exchange in the faster chunking: unchunked (or not `pipelined`) they
    add up; in k pipelined chunks chunk i is encoded while i-1 travels, so the longer of the two
    shows plus a k-th of the other, and every chunk pays the cost per exchange and its
    collectives' `collective` cost."""
    best = codec.time(elements, tensors) + wire + _collectives(1) * path.collective
    for chunk_bytes in CHUNK_CHOICES if path.pipelined else ():
        chunks = math.ceil(elements * FLOAT32_BYTES / chunk_bytes) if chunk_bytes else 1
        if chunks > 1:
            cpu = codec.time(elements, tensors) + codec.fixed * (chunks - 1)
            net = wire + _collectives(chunks) * path.collective
            best = min(best, max(cpu, net) + min(cpu, net) / chunks)
    return best


def _collectives(chunks: int) -> int:
    """A codes exchange's collectives: the metadata's Max-allreduce, then an alltoall and an
    allgather a chunk."""
    return 1 + 2 * chunks


# one step ---------------------------------------------------------------------------------------
StepModel = Callable[[Workload, Path, Cluster], float]  # step_time, or fsdp_step_time with its options bound


def step_time(w: Workload, path: Path, c: Cluster) -> float:
    """Seconds of one training step: forward, backward with the exchanges as their buckets are
    handed over, then the optimizer (_Timeline)."""
    timeline = _run(w, path, c)
    return w.compute - w.compute * w.backward + max(timeline.end, timeline.free) + w.optimizer


@dataclasses.dataclass
class _Timeline:
    """A step's exchanges in a backward that would end at `end` alone: each starts when its
    gradients are handed over (ready, and past the entry point's cost a gradient of every one
    before them) and the one before it has ended (`free`). Where compute shares the processor
    (`shared`) the costs a gradient lengthen the backward, and an exchange that starts before
    the backward has ended takes a share of its processor for as long as it runs (its processor
    time times the cluster's `contention`, its time on the links times `wire_contention`): the
    backward, and every gradient it makes after, come `delay` later."""
    path: Path
    c: Cluster
    shared: bool
    end: float
    free: float = 0.0
    delay: float = 0.0
    exchanges: list = dataclasses.field(default_factory=list)  # (start, elements, tensors) of each

    def handed(self, ready: float, before: float) -> float:
        """When a gradient ready `ready` seconds into the backward alone, with `before` gradients
        up to it, is handed over."""
        return ready + self.path.per_gradient * before + self.delay

    def run(self, handed: float, elements: float, tensors: float) -> None:
        start = max(handed, self.free)
        took = exchange_time(elements, self.path, self.c, tensors)
        if self.shared and start < self.end:
            lost = (self.c.contention * busy_time(elements, tensors, self.path, self.c)
                    + self.c.wire_contention * wire_time(elements, self.path, self.c))
            end = start + _slowed(self.end - start, took, lost)
            self.delay, self.end = self.delay + end - self.end, end
        self.free = start + took
        self.exchanges.append((start, elements, tensors))


def _run(w: Workload, path: Path, c: Cluster) -> _Timeline:
    """The step's exchanges run on its timeline: in the workload's buckets, or fused as
    Horovod's own allreduce fuses (`path.fusion_bytes`)."""
    backward = w.compute * w.backward
    timeline = _Timeline(path, c, w.shared_processor,
                         backward + (path.per_gradient * w.tensor_count if w.shared_processor else 0.0))
    if path.fusion_bytes and not path.codes:
        _fuse(w, timeline, backward)
        return timeline
    for n, done in zip(w.bucket_sizes(), itertools.accumulate(w.bucket_sizes())):
        timeline.run(timeline.handed(backward * w.ready(done), w.tensors_before(done)), n, w.tensors_in(n))
    return timeline


def _fuse(w: Workload, timeline: _Timeline, backward: float) -> None:
    """Horovod's tensor fusion: once the allreduce before has ended, the next takes every
    gradient handed over by then (at least one, at most `path.fusion_bytes`)."""
    grads, k = w.gradients(), 0
    cap = timeline.path.fusion_bytes * BITS_PER_BYTE / timeline.path.bits  # elements
    while k < len(grads):
        first, n = k, 0
        start = max(timeline.free, timeline.handed(backward * grads[k][1], k + 1))
        while k < len(grads) and (k == first or timeline.handed(backward * grads[k][1], k + 1) <= start
                                  and n + grads[k][0] <= cap):
            n, k = n + grads[k][0], k + 1
        timeline.run(start, n, k - first)


def _slowed(left: float, took: float, lost: float) -> float:
    """How long `left` seconds of compute take beside an exchange that runs `took` seconds and
    costs compute `lost` seconds of them, spread evenly (its share of the processor at most all
    of it): slowed while they overlap, then at full speed."""
    share = min(lost / took, 1.0) if took > 0 else 0.0
    if share < 1 and left <= took * (1 - share):
        return left / (1 - share)
    return left + share * took


def busy_time(elements: float, tensors: float, path: Path, c: Cluster) -> float:
    """Seconds of the processor computing the step an exchange takes: its passes outside the
    codec and the codec's own (on a device, the codec's host part only)."""
    codec = shared_codec(path.codec, c).busy(_codes_elements(elements, c), tensors) if path.codes else 0.0
    return processor_time(elements, path, c) + codec


# FSDP2's reduce-scatter on the codes: encode every row, sum this rank's row from N copies; about
# half the passes of a bucket exchange's codec (no re-encode, no allgather to decode), an assumption
SCATTER_CODEC_SHARE = 0.5


def passes_share(passes: float, world: int) -> float:
    """The share of a bucket exchange's codec time that `passes` passes over as many elements
    take: the bucket exchange encodes all, sums N rows of 1/N, re-encodes 1/N and decodes all
    (3 + 1/N passes)."""
    return passes / (3 + 1 / world)


def gather_codec_share(world: int) -> float:
    """A codes all-gather's share of a bucket exchange's codec time for as many elements: it
    encodes its own 1/N and decodes all N (1 + 1/N passes)."""
    return passes_share(1 + 1 / world, world)


def codes_all_gather(elements: float, path: Path, c: Cluster, tensors: float = 1) -> tuple:
    """(seconds on the links, seconds of codec) of gathering `elements` values owned 1/N a rank
    as codes, each block at its own exponent (hvd_aps.BlockCodes)."""
    return (allgather(codes_bytes(elements, path.bits) / c.world, c),
            gather_codec_share(c.world) * shared_codec(path.codec, c).time(elements, tensors))


def codes_reduce_scatter(elements: float, path: Path, c: Cluster, tensors: float = 1) -> tuple:
    """(seconds on the links, seconds of codec) of the codes exchange's scatter half over
    `elements` values: the metadata's Max-allreduce and one alltoall of the codes."""
    return (metadata_allreduce(c) + alltoall(codes_bytes(elements, path.bits), c),
            SCATTER_CODEC_SHARE * shared_codec(path.codec, c).time(elements, tensors))


def fsdp_step_time(w: Workload, path: Path, c: Cluster, reshard: bool = True, gloo: bool = False,
                   hsdp: bool = False, gather: Optional[Path] = None) -> float:
    """Seconds of one FSDP2 step with a unit per entry of `w.buckets` (one flat group, float32
    parameters): each unit's parameters all-gathered before its forward and, with `reshard`
    (reshard_after_forward; the root's stay gathered), again before its backward, in `gather`
    (None: float32; a 16-bit path: a MixedPrecisionPolicy's param_dtype; codes: hvd_aps.fsdp's
    params=, every block with its own exponent); its gradients reduce-scattered in `path` (codes:
    the metadata Max-allreduce and one alltoall of codes, hvd_aps.fsdp's exchange). Serial: FSDP2
    on the CPU waits for each collective where its compute needs it (streams are no-ops there),
    which the recorded FSDP rows bear out (a capped step is about the uncapped one plus its bytes
    at the link's rate). `gloo`: the framework's reduce-scatter moves an allreduce's bytes (torch's
    Gloo backend reduces the whole message everywhere: the recorded rows sent 2(N-1)/N of it a
    rank), NCCL's (N-1)/N. `hsdp`: HSDP's shape (hsdp_breakdown)."""
    wire, codec = (hsdp_breakdown if hsdp else fsdp_breakdown)(w, path, c, reshard, gloo, gather)
    return w.compute + w.optimizer + wire + codec


def fsdp_breakdown(w: Workload, path: Path, c: Cluster, reshard: bool = True, gloo: bool = False,
                   gather: Optional[Path] = None) -> tuple:
    """(seconds on the links, seconds of codec) of one FSDP2 step's collectives (fsdp_step_time)."""
    wire, codec = _gathers(w, c, reshard, gather)
    for n in w.bucket_sizes():
        if path.codes:
            links, passes = codes_reduce_scatter(n, path, c, w.tensors_in(n))
            wire, codec = wire + links, codec + passes
        else:
            wire += native_reduce_scatter(n * path.bits / BITS_PER_BYTE, c, gloo)
            codec += processor_time(n, path, c)
    return wire, codec


def hsdp_breakdown(w: Workload, path: Path, c: Cluster, reshard: bool = True, gloo: bool = False,
                   gather: Optional[Path] = None) -> tuple:
    """(seconds on the links, seconds of codec) of one HSDP step: every unit sharded over the L
    ranks of a host and replicated across hosts (torch's 2-D mesh, or hvd_aps.fsdp.host_mesh()).
    Inside the host the all-gathers (in `gather`) and FSDP's own reduce-scatter (in `path.bits` on
    the framework's path, its reduce dtype; float32 under codes); across hosts each rank's 1/L
    shard is averaged with its replicas on the other hosts, the L ranks of a host at once through
    its link: the framework's allreduce in `path.bits`, or (codes) the bucket exchange of the shard
    (hvd_aps.fsdp.CrossHostHook: metadata, alltoall, allgather, the whole codec). Serial, as
    fsdp_breakdown."""
    if not (c.hosts > 1 and c.ranks_per_host > 1):
        raise ValueError(f"HSDP shards inside a host and replicates across hosts: it needs several hosts of "
                         f"several ranks, got {c.hosts} x {c.ranks_per_host}")
    host, cross = _levels(c)
    wire, codec = _gathers(w, dataclasses.replace(host, sharing=c.sharing), reshard, gather)
    for n in w.bucket_sizes():
        wire += native_reduce_scatter(n * (FLOAT32_BYTES if path.codes else path.bits / BITS_PER_BYTE), host, gloo)
        shard = n / c.ranks_per_host
        if path.codes:  # every shard of the host's ranks together through its link
            codes = codes_bytes(n, path.bits)
            wire += metadata_allreduce(cross) + alltoall(codes, cross) + allgather(codes / c.hosts, cross)
            codec += shared_codec(path.codec, c).time(shard, w.tensors_in(shard))
        else:
            wire += allreduce(n * path.bits / BITS_PER_BYTE, cross)
            codec += processor_time(n, path, dataclasses.replace(host, sharing=c.sharing))
            codec += processor_time(shard, path, dataclasses.replace(cross, sharing=c.sharing))
    return wire, codec


def _gathers(w: Workload, c: Cluster, reshard: bool, gather: Optional[Path] = None) -> tuple:
    """(seconds on the links, seconds of codec) of a step's parameter all-gathers over `c`: two
    a unit with resharding (one for the root, the last unit, whose parameters stay gathered), in
    float32 (gather None), the gather path's bits, or its codes with their exponents."""
    units = w.bucket_sizes()
    counts = [1 if k == len(units) - 1 or not reshard else 2 for k in range(len(units))]
    wire = codec = 0.0
    for count, n in zip(counts, units):
        if gather is None or not gather.codes:
            wire += count * allgather(n * (FLOAT32_BYTES if gather is None else gather.bits / BITS_PER_BYTE) / c.world,
                                      c)
            continue
        links, passes = codes_all_gather(n, gather, c, w.tensors_in(n))  # count is 1 or 2: exact scaling
        wire, codec = wire + count * links, codec + count * passes
    return wire, codec


def native_reduce_scatter(nbytes: float, c: Cluster, gloo: bool) -> float:
    """The framework's reduce-scatter of `nbytes`: an allreduce's traffic on Gloo (torch's Gloo
    backend reduces the whole message everywhere), an alltoall's on NCCL."""
    return allreduce(nbytes, c) if gloo else alltoall(nbytes, c)


def fsdp_units(parameters: int, units: int) -> list:
    """`units` FSDP units of (nearly) equal sizes holding the parameters, the root's last."""
    if not 1 <= units <= parameters:
        raise ValueError(f"FSDP units must be between 1 and the {parameters} parameters, got {units}")
    return [parameters // units + (k < parameters % units) for k in range(units)]


def break_even(w: Workload, path: Path, peer: Path, c: Cluster, low: float = 1e6 / 8,
               high: float = 1e12 / 8, step: StepModel = step_time) -> Optional[float]:
    """The fastest link between hosts (bytes/s, between low and high) at which `path` still
    steps faster than `peer` (by `step`: step_time, or an FSDP2 step), everything else as in
    `c`; None where it never does."""
    def wins(bandwidth):
        at = dataclasses.replace(c, between=Link(bandwidth, c.between.latency))
        return step(w, path, at) < step(w, peer, at)
    if not wins(low):
        return None
    if wins(high):
        return high
    for _ in range(60):  # bisection on a log scale: the margin shrinks as the link gets faster
        mid = math.sqrt(low * high)
        low, high = (mid, high) if wins(mid) else (low, mid)
    return low


def breakdown(w: Workload, path: Path, c: Cluster) -> tuple:
    """(seconds on the links, seconds of processor: codec, passes and the entry point's per
    gradient) a step's exchanges add up to, overlaps ignored."""
    exchanges = _run(w, path, c).exchanges
    codec = sum(shared_codec(path.codec, c).time(_codes_elements(n, c), t) for _, n, t in exchanges) if path.codes else 0.0
    processor = sum(processor_time(n, path, c) for _, n, _ in exchanges) + path.per_gradient * w.tensor_count
    return sum(wire_time(n, path, c) for _, n, _ in exchanges), codec + processor


def table(w: Workload, paths: Sequence[Path], c: Cluster, step: StepModel = step_time) -> list:
    """(path, predicted step seconds, x the float32 allreduce's step), one row a path; paths[0]
    must be the float32 allreduce."""
    base = step(w, paths[0], c)
    return [(p, t, t / base) for p in paths for t in [step(w, p, c)]]


def sweep(w: Workload, paths: Sequence[Path], c: Cluster, bandwidths: Sequence[float],
          step: StepModel = step_time) -> dict:
    """Predicted step seconds per path name at each link bandwidth between hosts."""
    return {p.name: [step(w, p, dataclasses.replace(c, between=Link(b, c.between.latency))) for b in bandwidths]
            for p in paths}
