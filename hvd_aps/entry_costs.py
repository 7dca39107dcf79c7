"""What each entry point costs inside a running job beyond what the performance model
(hvd_aps.perf) computes from the link and the codec, and how much the exchange slows compute
where they share the cores. `python -m hvd_aps calibrate --links --entry-points` measures them on
every rank of a horovodrun job (Horovod's optimizer in float32 and 16-bit, the one line,
hvd_aps.torch's optimizer) or a torchrun one (DDP's allreduce, its fp16_compress_hook,
hvd_aps.ddp.aps_hook), and each format's codes.

A model of vectors of ELEMENTS float32 (a gradient each, next to no compute) steps through each
path at FEW and at MANY tensors; two costs are solved so that the model, with the link measured
in the same job and the codec's calibration, gives back the steps: perf.EntryCost.processor (an
element's: 16-bit casts and sums, the codec in a job) from FEW, perf.EntryCost.per_gradient (a
hook, an enqueue, a name's negotiation) from MANY. Solved through the model, since a difference of
steps misses what the model hides under the exchanges. Contention (perf.Cluster.contention,
wire_contention): the share of the processor matrix products lose to exchanges running beside.
"""
import dataclasses
import math
import statistics
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from . import calibration, perf
from .formats import FloatFormat
from .perf import FLOAT32_PATH as FLOAT32, HALF_PATH as HALF, EntryCost, EntryPoint, NativePath, codes_path

ELEMENTS = 1 << 22     # float32 of the timed model: 16 MiB, as a DDP bucket or a Horovod fusion buffer
FEW, MANY = 4, 512     # its tensors: the cost per element solved at FEW, the cost a gradient at MANY
NATIVE_BITS = {FLOAT32: 32, HALF: 16}
WARMUP = 5             # untimed steps once the run-time schedule has settled
ROUNDS, BLOCK = 6, 5   # timed steps: ROUNDS blocks of BLOCK a model, alternated; the median is kept
REPEATS = 15           # steps of compute alone, and exchanges alone, timed for the medians
SETTLE_STEPS = 200     # at most, for the run-time schedule to decide every bucket
SOLVE_ROUNDS = 60      # bisections of a cost
JOINT_ROUNDS = 6       # the two costs solved in turn, each with the other held (the step at FEW moves
                       # little with the cost a gradient: the miss shrinks about fourfold a round)
MAX_PROCESSOR = 1e-6   # s per element: the bounds it is solved between (below zero: faster in the job)
MAX_PER_GRADIENT = 1e-2  # s a gradient: the bound it is solved under
MATRIX = 512           # the contention's compute: products of MATRIX x MATRIX float32
CONTENTION_PRODUCTS = 200
OUTLAST = 2            # the work beside it runs about this many times as long as the compute alone
JOIN_S = 60            # beyond its calls' time, what the work's thread gets to end


class Vectors(torch.nn.Module):
    """`tensors` parameter vectors holding `elements` between them; the loss is their dot product
    with fixed vectors, so each gradient is dense and the compute next to nothing."""

    def __init__(self, tensors: int, elements: int = ELEMENTS, device: str = "cpu"):
        super().__init__()
        sizes = [elements // tensors + (k < elements % tensors) for k in range(tensors)]
        generator = torch.Generator().manual_seed(0)
        self.vectors = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes)
        self.fixed = [(torch.randn(n, generator=generator) * 1e-3).to(device) for n in sizes]

    def forward(self):
        return sum((p * c).sum() for p, c in zip(self.vectors, self.fixed))


@dataclasses.dataclass
class Trainer:
    """A model stepping through one path: `forward()` gives the loss; `compressor`: the path's
    APSCompressor (its run-time schedule is waited for), `close`: what ends the path's threads."""
    forward: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    compressor: object = None
    close: Callable[[], None] = lambda: None

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.forward().backward()
        self.optimizer.step()


class Job:
    """The running job the measurements run in: who it is (`name` of its framework, `rank`,
    `hosts`, `world`), its float32 `allreduce` (the link's measurement), the entry points its
    launcher offers and the optimizer of each path, and the collectives that keep the ranks
    together. One subclass a launcher."""
    name: str
    rank: int
    hosts: int
    world: int
    entries: tuple = ()
    device: str = "cpu"  # where the timed models live

    def allreduce(self, values: np.ndarray) -> None:
        raise NotImplementedError

    def prepare(self, entry: EntryPoint, path: str, fmt: str, model: Vectors, label: str) -> Trainer:
        """`model` stepping through `path` of `entry` (its parameters' names prefixed with `label`)."""
        raise NotImplementedError

    def allgather_object(self, obj) -> list:
        raise NotImplementedError

    def finish(self, clean: bool = True) -> None:
        """Leave the job; `clean`: every rank got here alike (else skip what waits for the others)."""
        raise NotImplementedError


class HorovodJob(Job):
    """A horovodrun job, through Horovod's torch binding (a host is a group of local ranks)."""
    entries = (EntryPoint.HOROVOD, EntryPoint.CODES)

    def __init__(self):
        import horovod.torch as hvd
        hvd.init()
        self.hvd, self.name = hvd, "Horovod"
        self.rank, self.hosts, self.world = hvd.rank(), hvd.cross_size(), hvd.size()

    def allreduce(self, values):
        self.hvd.allreduce(torch.from_numpy(values), op=self.hvd.Sum, name=f"calibrate.{values.size}")

    def prepare(self, entry, path, fmt, model, label):
        from . import APSCompressor
        from .torch import DistributedOptimizer
        named = [(f"{label}.{k}", p) for k, p in enumerate(model.parameters())]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if isinstance(path, NativePath):
            compression = self.hvd.Compression.none if path is FLOAT32 else self.hvd.Compression.fp16
            return Trainer(model, self.hvd.DistributedOptimizer(opt, named_parameters=named, compression=compression))
        compressor = APSCompressor(fmt)
        wrap = DistributedOptimizer if entry is EntryPoint.CODES else self.hvd.DistributedOptimizer
        return Trainer(model, wrap(opt, named_parameters=named, compression=compressor), compressor, compressor.close)

    def allgather_object(self, obj):
        return self.hvd.allgather_object(obj)

    def finish(self, clean=True):
        self.hvd.shutdown()


class TorchJob(Job):
    """A torchrun job: torch.distributed over Gloo (NCCL where CUDA is there); a host is a
    distinct launcher place."""
    entries = (EntryPoint.DDP,)

    def __init__(self):
        import os
        import torch.distributed as dist
        from ._topology import launcher_place
        from .ddp import TorchDistributedCollectives
        accelerated = torch.cuda.is_available()
        self.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if accelerated else "cpu"
        dist.init_process_group("nccl" if accelerated else "gloo")
        self.dist, self.name = dist, "torch.distributed"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.hosts = len(set(self.allgather_object(launcher_place()[0])))
        self.collectives = TorchDistributedCollectives(None, self.device)

    def allreduce(self, values):
        self.collectives.allreduce(values, "calibrate")

    def prepare(self, entry, path, fmt, model, label):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        from . import APSCompressor, ddp
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if path is HALF:
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if isinstance(path, NativePath):
            return Trainer(wrapped, opt)
        compressor = APSCompressor(fmt)
        state = ddp.APSState(compressor)
        wrapped.register_comm_hook(state, ddp.aps_hook)
        return Trainer(wrapped, opt, compressor, state.close)

    def allgather_object(self, obj):
        gathered = [None] * self.world
        self.dist.all_gather_object(gathered, obj)
        return gathered

    def finish(self, clean=True):
        if clean:
            self.dist.barrier()  # a rank tearing Gloo down while another still talks can abort
        self.dist.destroy_process_group()


def settle(trainer: Trainer, job: Job) -> None:
    """Step until the trainer's run-time schedule (if it has one) has decided every bucket on
    every rank, then WARMUP steps more."""
    compressor = trainer.compressor
    for _ in range(SETTLE_STEPS):
        if all(job.allgather_object(compressor is None or all(row["chosen"] for row in compressor.schedule_report()))):
            break
        trainer.step()
    for _ in range(WARMUP):
        trainer.step()


def time_pair(job: Job, entry: EntryPoint, path: str, fmt: str) -> dict:
    """{tensors: median step} of Vectors models of FEW and MANY tensors through `path` of
    `entry`, both built and settled first, then timed in ROUNDS alternating blocks (the machine's
    drifts fall on both alike); every rank the same figures."""
    trainers = {n: job.prepare(entry, path, fmt, Vectors(n, device=job.device), f"calibrate.{n}") for n in (FEW, MANY)}
    try:
        for trainer in trainers.values():
            settle(trainer, job)
        times = {n: [] for n in trainers}
        for _ in range(ROUNDS):
            for n, trainer in trainers.items():
                for _ in range(BLOCK):
                    started = time.perf_counter()
                    trainer.step()
                    times[n].append(time.perf_counter() - started)
        return {n: statistics.median(job.allgather_object(statistics.median(t))) for n, t in times.items()}
    finally:
        for trainer in trainers.values():
            trainer.close()


def compute_profile(tensors: int, entry: EntryPoint) -> perf.Workload:
    """The Vectors model's own compute, no exchange (hvd_aps.step_profile), in `entry`'s buckets."""
    from . import step_profile
    model = Vectors(tensors)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    profile = step_profile.measure(model, model, opt, repeats=REPEATS)
    return profile.workload(buckets=perf.entry_buckets(profile.parameters, entry))


def solve(predicted: Callable[[float], float], measured: float, low: float, high: float) -> float:
    """The value between `low` and `high` at which `predicted(value)`, rising with it, meets
    `measured` (bisection; the bound where it never does). Where it rises unevenly (Horovod's
    fusion regroups the gradients as their hand-overs spread) a crossing near the measured one."""
    for _ in range(SOLVE_ROUNDS):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    return (low + high) / 2


def solve_costs(model: Callable[[int, EntryCost], float], steps: dict, per_element: bool = True) -> EntryCost:
    """The EntryCost at which `model(tensors, cost)` gives back the `steps` measured at FEW and at
    MANY tensors: the cost per element (where `per_element`) the step at FEW, the cost a gradient
    (at least zero) the step at MANY; each solved with the other held, JOINT_ROUNDS times (once
    without a cost per element: then what the link's fit misses of the step at MANY is counted in
    the cost a gradient)."""
    cost = EntryCost()
    for _ in range(JOINT_ROUNDS if per_element else 1):
        if per_element:
            cost = dataclasses.replace(cost, processor=solve(
                lambda c: model(FEW, dataclasses.replace(cost, processor=c)), steps[FEW], -MAX_PROCESSOR,
                MAX_PROCESSOR))
        cost = dataclasses.replace(cost, per_gradient=solve(
            lambda g: model(MANY, dataclasses.replace(cost, per_gradient=g)), steps[MANY], 0.0, MAX_PER_GRADIENT))
    return cost


def entry_cost(job: Job, entry: EntryPoint, path: str, fmt: str, codec: Optional[perf.Codec],
               cluster: perf.Cluster, bits: int, work: dict) -> tuple:
    """(the path's EntryCost on this job's `cluster`, its link measured in the same job, the
    models' compute `work` ({tensors: compute_profile}); the measured {tensors: median step})."""
    steps = time_pair(job, entry, path, fmt)

    def model(tensors, cost):
        return perf.step_time(work[tensors], perf.entry_path(path, bits, codec, entry, cost), cluster)
    # the float32 allreduce's link is fitted on it: nothing per element beyond it
    return solve_costs(model, steps, per_element=path is not FLOAT32), steps


def time_contention(work: Callable[[], None], job: Job, products: int = CONTENTION_PRODUCTS) -> float:
    """The share of the processor compute loses while `work` (a codes exchange, or the
    framework's allreduce) runs beside it over and over: every rank times `products` matrix
    products at torch's threads alone, then with a thread making enough calls of `work` to
    outlast them (as many on every rank: a collective must be called alike everywhere)."""
    a = torch.randn(MATRIX, MATRIX)

    def compute():
        started = time.perf_counter()
        for _ in range(products):
            a @ a
        return time.perf_counter() - started
    compute()
    alone = max(job.allgather_object(compute()))
    one = min(job.allgather_object(statistics.median(_timed(work) for _ in range(REPEATS))))
    calls = math.ceil(OUTLAST * alone / one) + 1

    failed = []  # what stopped the calls

    def run():
        try:
            for _ in range(calls):
                work()
        except Exception as error:  # raised on the caller's thread, below
            failed.append(error)
    thread = threading.Thread(target=run, daemon=True)
    job.allgather_object(None)  # every rank starts together
    thread.start()
    shared = compute()
    bound = JOIN_S + OUTLAST * calls * one
    thread.join(timeout=bound)  # bounded: its calls, with room
    if thread.is_alive():
        raise RuntimeError(f"the exchanges run beside the compute did not end within {bound:.0f} s: a rank may "
                           f"have left the job")
    if failed:
        raise RuntimeError("the exchanges run beside the compute failed") from failed[0]
    return max(0.0, 1 - alone / max(job.allgather_object(shared)))


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(job: Job, cluster: perf.Cluster, formats: Sequence[str], codecs: dict,
            progress: Callable[[str], None] = lambda _: None) -> dict:
    """{"contention": the codec's (perf.Cluster.contention), "wire_contention": the framework's
    float32 allreduce's (perf.Cluster.wire_contention), "entry_points": {entry: {path:
    EntryCost}}, "steps": {entry: {path: {tensors: seconds}}}} of this job, each format's codes
    paths with its codec (`codecs`); the costs are solved with the contentions measured first."""
    progress("contention")
    with calibration.exchange_runner(formats[0], job.world, ELEMENTS, 1) as exchange:
        contention = time_contention(exchange, job)
    values = np.ones(ELEMENTS, np.float32)
    contentions = {"contention": contention, "wire_contention": time_contention(lambda: job.allreduce(values), job)}
    cluster = dataclasses.replace(cluster, **contentions)
    entries, steps = {}, {}
    for entry in job.entries:
        work = {n: compute_profile(n, entry) for n in (FEW, MANY)}  # once an entry point: its paths alike
        for path, fmt in entry_paths(entry, formats):
            progress(f"{entry.value} {path}")
            codec, bits = (codecs[fmt], FloatFormat.parse(fmt).bits) if fmt else (None, NATIVE_BITS[path])
            entries.setdefault(entry, {})[path], steps.setdefault(entry, {})[path] = entry_cost(
                job, entry, path, fmt or formats[0], codec, cluster, bits, work)
    return contentions | {"entry_points": entries, "steps": steps}


def entry_paths(entry: EntryPoint, formats: Sequence[str]) -> list:
    """(path name, format or None) of every path `entry` offers: its framework's float32 and
    16-bit allreduce, then each format's codes."""
    natives = () if entry is EntryPoint.CODES else ((FLOAT32, None), (HALF, None))
    return [*natives, *((codes_path(fmt), fmt) for fmt in formats)]
