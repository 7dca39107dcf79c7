"""Training-step time of hvd_aps's torch entry points against the framework's own, on one GPU.

In one process: DDP with no hook, with torch's bf16_compress_hook and with hvd_aps.ddp.aps_hook
(e4m3) on ResNet-50, a GPT-2-small shape and two 8192x8192 layers; FSDP2 alone and with
hvd_aps.fsdp.apply on the GPT-2 shape. Then, per variant, torch.profiler's synchronisations,
copies and kernels per steady step, and steady steps under torch's sync debug mode and (hvd_aps's
variants) CuPy's allow_synchronize(False).

    torchrun --standalone --nproc_per_node 1 examples/gpu_step_benchmark.py --out step_benchmark.json
    python examples/gpu_step_benchmark.py --device cpu --smoke --out smoke.json   # Gloo, tiny shapes

World 1 over NCCL is the main use: its collectives are nearly free, so what a variant adds to
DDP's own step is its compression's own cost. Every variant is a model of its own (one comm hook
per DDP model), all from the same initial weights; each is warmed up (at least --warmup steps,
until its compressor's run-time schedule has decided every bucket and its step time has
settled), then the variants' timed steps alternate round by round, in each order by turns, so a
drift of the machine's speed moves them all alike. A step is forward, backward and the SGD step,
timed by CUDA events on the current stream. Rank 0 prints each model's rows as it finishes and
rewrites --out, so a run cut short keeps what it measured.
"""
import argparse
import collections
import contextlib
import copy
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
import hvd_aps.fsdp
from benchmark_common import settle
from pytorch_fsdp_synthetic_benchmark import shard
from synthetic_models import GPT, ResNet18, lm_loss

# the order they run in, a run cut short keeping the first: FSDP2 last, as at world 1 it makes no
# reduce-scatter for codes to go into (its step still runs with hvd_aps.fsdp.apply's settings)
MODELS = ("resnet50", "gpt2", "linear8192", "fsdp-gpt2")
VARIANTS = ("none", "bf16", "aps")
LABELS = {"ddp": {"none": "ddp", "bf16": "ddp+bf16_hook", "aps": "ddp+aps_hook"},
          "fsdp": {"none": "fsdp2", "aps": "fsdp2+aps"}}
# (model, variant) -> (the variant it is judged against, the most its median step may take of that one's)
TARGETS = {("resnet50", "aps"): ("bf16", 1.05), ("gpt2", "aps"): ("bf16", 1.05),
           ("linear8192", "aps"): ("none", 1.3), ("fsdp-gpt2", "aps"): ("none", 1.05)}
HOST_SYNCS_PER_BUCKET = 1  # the most host synchronisations a steady step may take per bucket exchanged
LR, MOMENTUM = 1e-4, 0.9  # SGD: small enough that random targets keep every step finite

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # torch's, CuPy's
D2H_COPY = "Memcpy DtoH"  # how the profiler names a device-to-host copy the device ran
STEP_MARK = "gpu_step_benchmark.step"  # the profiler's range around each profiled step
# the profiler's device events that are not kernels (besides annotations' ranges): copies, fills,
# CUPTI's synchronisation records
NOT_KERNEL_PREFIXES = ("Memcpy", "Memset", "Event Sync", "Stream Sync", "Stream Wait Event", "Context Sync")
WHERE_SHOWN = 5  # source lines kept per check, most frequent first
MESSAGE_CHARS = 600  # of an exception's message kept in the JSON
ERROR_SHOWN = 100  # of it in the table
MET = {True: "yes", False: "NO", None: "n/a"}  # a target met, missed, not judged (no codes ran)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The workloads' sizes: the targets' shapes, or tiny ones for a CPU smoke run."""
    resnet: tuple  # batch, image side, classes
    gpt: dict  # synthetic_models.GPT's arguments
    tokens: tuple  # sequences, tokens each
    linear: tuple  # width, batch


def paced(text: str):
    """A Pace field, its command-line help `text`."""
    return dataclasses.field(metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class Pace:
    """How many steps each phase runs."""
    warmup: int = paced("steps before any is judged (the hook's schedule trials its first steps)")
    window: int = paced("steps whose median is compared with the previous window's to call the step time settled")
    tolerance: float = paced("relative change between two windows still called settled")
    max_windows: int = paced("windows at most before timing anyway")
    rounds: int = paced("rounds of timed steps, the variants alternating")
    steps: int = paced("timed steps per variant and round")
    profile_steps: int = paced("steps under torch.profiler per variant")
    check_steps: int = paced("steps under each synchronisation check per variant")


FULL = Shapes((64, 224, 1000), dict(vocab=50257, width=768, heads=12, layers=12, positions=1024), (8, 512),
              (8192, 256))
SMOKE = Shapes((2, 32, 10), dict(vocab=256, width=32, heads=2, layers=2, positions=16), (2, 16), (128, 4))
# full: planned for about 3 minutes of the four models on an H100/H200, from the step times docs/gpu.md
# measured (aps_hook then 7-8x the bf16 hook); not itself measured yet
PACES = {False: Pace(30, 5, 0.05, 6, 6, 5, 3, 3), True: Pace(2, 2, 1.0, 1, 2, 2, 1, 1)}
DDP_BUCKET_MB = 25  # DDP's default bucket_cap_mb, stated: the aps rows' buckets depend on it
STARTED = time.monotonic()


@dataclasses.dataclass
class Workload:
    """A model on the device with its batch: what each variant copies and trains."""
    name: str
    kind: str  # "ddp" or "fsdp"
    describe: str
    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss: Callable


@dataclasses.dataclass
class Variant:
    """One way to train a workload, and what was measured of it."""
    name: str  # none | bf16 | aps
    label: str  # the table's
    step: Callable
    compressor: Optional[hvd_aps.APSCompressor] = None
    exchanges: Optional[Callable[[], int]] = None  # DDP: the hook's bucket exchanges so far
    units: int = 0  # FSDP2: the units whose reduce-scatter sends codes
    close: Callable = lambda: None
    times: list = dataclasses.field(default_factory=list)  # ms of each timed step
    warmup_steps: int = 0
    checks: dict = dataclasses.field(default_factory=dict)


def resnet50(shapes: Shapes, device) -> Workload:
    """torchvision's ResNet-50, channels_last (a smoke run: synthetic_models' ResNet-18 at width 8,
    with no torchvision needed)."""
    batch, side, classes = shapes.resnet
    if shapes is SMOKE:
        net, describe = ResNet18(classes, width=8), f"ResNet-18 width 8 (smoke), b{batch} {side}x{side}"
    else:
        from torchvision.models import resnet50 as torchvision_resnet50
        net, describe = torchvision_resnet50(weights=None), f"ResNet-50, b{batch} {side}x{side}, channels_last"
    x = torch.randn(batch, 3, side, side, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(classes, (batch,), device=device)
    return Workload("resnet50", "ddp", describe, net.to(device, memory_format=torch.channels_last), x, y,
                    F.cross_entropy)


def gpt2(shapes: Shapes, device, kind="ddp") -> Workload:
    """GPT-2 small's shape (synthetic_models.GPT, untrained) on random tokens."""
    sequences, length = shapes.tokens
    net = GPT(**shapes.gpt).to(device)
    tokens = torch.randint(shapes.gpt["vocab"], (sequences, length + 1), device=device)
    describe = (f"GPT {shapes.gpt['layers']} x {shapes.gpt['width']}, {shapes.gpt['heads']} heads, "
                f"vocab {shapes.gpt['vocab']}, b{sequences} x {length}")
    return Workload("gpt2" if kind == "ddp" else "fsdp-gpt2", kind, describe, net, tokens[:, :-1], tokens[:, 1:],
                    lm_loss)


def linear8192(shapes: Shapes, device) -> Workload:
    """Two width x width Linear layers: a few huge tensors, little compute per byte sent."""
    width, batch = shapes.linear
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    return Workload("linear8192", "ddp", f"two {width}x{width} Linear, b{batch}", net.to(device),
                    torch.randn(batch, width, device=device), torch.randn(batch, width, device=device), F.mse_loss)


WORKLOADS = {"resnet50": resnet50, "gpt2": gpt2, "fsdp-gpt2": lambda s, d: gpt2(s, d, "fsdp"),
             "linear8192": linear8192}


def train_step(model, work: Workload, autocast: bool) -> Callable:
    """forward (under bf16 autocast for DDP; FSDP2's policy casts itself), backward, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    device_type = work.x.device.type

    def step():
        with torch.autocast(device_type, torch.bfloat16, enabled=autocast):
            loss = work.loss(model(work.x), work.y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def ddp_variant(work: Workload, name: str, device) -> Variant:
    """DDP over a copy of the model with `name`'s comm hook (none: DDP's own allreduce)."""
    ddp = DDP(copy.deepcopy(work.model), device_ids=[device] if device.type == "cuda" else None,
              bucket_cap_mb=DDP_BUCKET_MB)
    variant = Variant(name, LABELS["ddp"][name], train_step(ddp, work, autocast=True))
    if name == "bf16":
        ddp.register_comm_hook(None, bf16_hook(device))
    elif name == "aps":
        compressor = hvd_aps.APSCompressor(hvd_aps.e4m3)
        state = hvd_aps.ddp.APSState(compressor)
        ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
        variant.compressor, variant.exchanges = compressor, lambda: state.buckets_exchanged
        variant.close = lambda: (state.close(), compressor.close())
    return variant


def bf16_hook(device) -> Callable:
    """torch's bf16_compress_hook; on the CPU (a smoke run) under another name, since DDP refuses
    that one by name without NCCL although Gloo carries bfloat16."""
    if device.type == "cuda":
        return default_hooks.bf16_compress_hook

    def gloo_bf16_compress_hook(process_group, bucket):
        return default_hooks.bf16_compress_hook(process_group, bucket)
    return gloo_bf16_compress_hook


def fsdp_variant(work: Workload, name: str, device) -> Variant:
    """FSDP2 over a copy of the model, every block a unit, bf16 parameters and a float32
    reduce-scatter (aps: hvd_aps.fsdp.apply's codes in it)."""
    model = copy.deepcopy(work.model)
    shard(model, reshard=True, reduce_dtype=torch.float32, param_dtype=torch.bfloat16)
    step = train_step(model, work, autocast=False)
    if name != "aps":
        return Variant(name, LABELS["fsdp"][name], step)
    compressor = hvd_aps.APSCompressor(hvd_aps.e4m3)
    units = hvd_aps.fsdp.apply(model, compressor)
    return Variant(name, LABELS["fsdp"][name], step, compressor, units=units, close=compressor.close)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Milliseconds of each of n steps: CUDA events on the current stream around each (from the
    device reaching a step's start to reaching its end: its work, and its idle waits for a host
    that holds it up), or the host's clock on the CPU, where a step is synchronous."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, step: Callable, n: int) -> list:
        if not self.cuda:
            return [self._host(step) for _ in range(n)]
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in pairs:
            start.record()
            step()
            end.record()
        pairs[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in pairs]

    @staticmethod
    def _host(step: Callable) -> float:
        started = time.perf_counter()
        step()
        return (time.perf_counter() - started) * 1e3


def agree(flag) -> list:
    """Every rank's `flag`: ranks must run the same steps, so each stop is decided together."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flag)
    return gathered


def warm_up(variant: Variant, clock: Clock, pace: Pace) -> int:
    """pace.warmup steps, then until the compressor's schedule has decided every bucket
    (benchmark_common.settle), then until a window's median step is within pace.tolerance of the
    previous window's (at most pace.max_windows windows) -> the steps run."""
    clock.time(variant.step, pace.warmup)
    steps, previous = pace.warmup + settle(variant.step, variant.compressor, agree), None
    for _ in range(pace.max_windows):
        now = statistics.median(clock.time(variant.step, pace.window))
        steps += pace.window
        if all(agree(previous is not None and abs(now - previous) <= pace.tolerance * previous)):
            break
        previous = now
    return steps


def profiled(variant: Variant, device, steps: int) -> dict:
    """torch.profiler over `steps` steady steps (after one it warms up on) -> per step: the CUDA
    runtime's synchronisations and copies (in any thread), the device-to-host copies and kernels
    the device ran, and an aps variant's bucket exchanges."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    exchanges = variant.exchanges or (lambda: 0)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        variant.step()
        prof.step()
        exchanged, coded = exchanges(), coded_elements(variant)
        for _ in range(steps):
            with torch.profiler.record_function(STEP_MARK):
                variant.step()
            prof.step()
    counts = per_step(prof.events(), steps)
    coded = (coded_elements(variant) - coded) / steps if variant.compressor else None
    buckets = buckets_per_step(variant, (exchanges() - exchanged) / steps, coded)
    syncs = sum(counts[name] for name in SYNC_CALLS)
    return {**counts, "buckets": buckets, "host_syncs_per_bucket": syncs / buckets if buckets else None,
            "coded_elements": coded}


def coded_elements(variant: Variant) -> int:
    """Elements the variant's compressor has put through codes so far (its stats' totals): a
    step's share shows whether the codes ran at all."""
    return variant.compressor.totals().elements if variant.compressor else 0


def buckets_per_step(variant: Variant, exchanged: float, coded: Optional[float]) -> Optional[float]:
    """An hvd_aps variant's exchanges per step: DDP's buckets as the hook counted them; FSDP2's
    units, one reduce-scatter each, where any element went through codes (FSDP2 makes no
    reduce-scatter where its group has one rank: it copies the gradients instead)."""
    if variant.exchanges:
        return exchanged
    if variant.units:
        return float(variant.units) if coded else 0.0
    return None


def per_step(events, steps: int) -> dict:
    """The profiler's events -> per step: calls of each counted runtime function and of the launch
    functions made while a step ran (not the profiler's own synchronisation when it stops), and the
    device's D2H copies and kernels."""
    marks = [e.time_range for e in events if e.name == STEP_MARK and e.device_type == DeviceType.CPU]
    first, last = min(r.start for r in marks), max(r.end for r in marks)
    host, device = collections.Counter(), collections.Counter()
    for event in events:
        if event.device_type != DeviceType.CUDA:
            host[event.name] += first <= event.time_range.start <= last
        elif not (event.is_user_annotation or event.name.startswith(NOT_KERNEL_PREFIXES)):
            device["kernels"] += 1
        else:
            device["d2h_copies"] += event.name.startswith(D2H_COPY)
    return {name: host[name] / steps for name in SYNC_CALLS + COPY_CALLS} | {
        "launch_calls": sum(host[name] for name in LAUNCH_CALLS) / steps,
        **{name: device[name] / steps for name in ("d2h_copies", "kernels")}}


def sync_warnings(variant: Variant, device, steps: int) -> dict:
    """Steady steps under torch.cuda.set_sync_debug_mode("warn") -> torch's synchronising calls per
    step and the source lines that made the most. The warning filters are the process's, so calls
    in the hook's threads count too (autograd replays its workers' warnings in the caller)."""
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                variant.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{short_path(w.filename)}:{w.lineno}" for w in syncs)
    return {"per_step": len(syncs) / steps, "where": dict(where.most_common(WHERE_SHOWN))}


class SharedSyncFlag:
    """CuPy's allow_synchronize flag, one for every thread, noting the call stack of each
    synchronisation it is asked about while forbidden (CuPy raises there; the stack says where in
    hvd_aps, which an exception crossing DDP's lane threads may not)."""

    def __init__(self):
        self._allowed, self.stacks = True, []

    @property
    def allowed(self) -> bool:
        if not self._allowed:
            self.stacks.append(traceback.extract_stack()[:-2])  # less this getter and CuPy's _is_allowed
        return self._allowed

    @allowed.setter
    def allowed(self, value: bool) -> None:
        self._allowed = value


@contextlib.contextmanager
def cupy_sync_forbidden(cupyx, syncdetect):
    """cupyx.allow_synchronize(False) in every thread -> the SharedSyncFlag. CuPy keeps the flag per
    thread (in cupy._core.syncdetect), but the exchanges run in DDP's lane threads and autograd's
    device threads: for the check the module's thread-local becomes one flag every thread reads."""
    per_thread, syncdetect._thread_local = syncdetect._thread_local, SharedSyncFlag()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy's own: allow_synchronize is deprecated
            with cupyx.allow_synchronize(False):
                yield syncdetect._thread_local
    finally:
        syncdetect._thread_local = per_thread


def cupy_check(variant: Variant, device, steps: int) -> dict:
    """Steady steps with CuPy's synchronisations forbidden -> whether one raised, what, and where
    (the innermost frames of the first). Run last on a variant: a hook that raised may leave its
    DDP model unusable."""
    try:
        import cupyx
        from cupy._core import syncdetect
    except ImportError as error:
        return {"ran": False, "reason": str(error)}
    synchronize(device)
    try:
        with cupy_sync_forbidden(cupyx, syncdetect) as flag:
            for _ in range(steps):
                variant.step()
            synchronize(device)
    except Exception as error:  # the check's finding, not the run's end
        where = [f"{short_path(f.filename)}:{f.lineno} {f.name}" for f in (flag.stacks or [[]])[0][-WHERE_SHOWN:]]
        return {"ran": True, "raised": True, "type": type(error).__name__, "message": str(error)[:MESSAGE_CHARS],
                "where": where, "syncs_asked": len(flag.stacks)}
    return {"ran": True, "raised": False}


def guarded(check: Callable, *args) -> dict:
    """A check's result, or what it raised: a failing check never ends the run."""
    try:
        return check(*args)
    except Exception as error:
        return {"error": failure(error)}


def failure(error: BaseException) -> str:
    """What an error says, short enough for the JSON; its traceback goes to the log."""
    traceback.print_exception(error)
    return f"{type(error).__name__}: {str(error)[:MESSAGE_CHARS]}"


def short_path(path: str) -> str:
    """A source path from its package or the examples on, to keep the table narrow."""
    parts = path.split(os.sep)
    for anchor in ("hvd_aps", "torch", "examples"):
        if anchor in parts:
            return os.sep.join(parts[len(parts) - parts[::-1].index(anchor) - 1:])
    return path


def measure_model(name: str, names: list, args, device) -> dict:
    """Every wanted variant of one workload: warmed up, timed in alternating rounds, profiled,
    checked; closed whatever happens."""
    pace, shapes = args.pace, SMOKE if args.smoke else FULL
    work = WORKLOADS[name](shapes, device)
    make = ddp_variant if work.kind == "ddp" else fsdp_variant
    variants = [made(make, work, v, device) for v in names if v in LABELS[work.kind]]
    clock = Clock(device)
    try:
        live = [v for v in variants if warmed(name, v, clock, pace)]
        for r in range(pace.rounds):
            for v in live if r % 2 == 0 else live[::-1]:
                v.times += clock.time(v.step, pace.steps)
        log(f"{name}: {pace.rounds} rounds timed")
        for v in live:
            v.checks["profile"] = guarded(profiled, v, device, pace.profile_steps)
            if device.type == "cuda":
                v.checks["sync_warnings"] = guarded(sync_warnings, v, device, pace.check_steps)
        for v in live:
            if device.type == "cuda" and v.compressor is not None:
                v.checks["cupy"] = guarded(cupy_check, v, device, pace.check_steps)
        log(f"{name}: checked")
        return summary(work, variants)
    finally:
        for v in variants:
            v.close()


def made(make: Callable, work: Workload, name: str, device) -> Variant:
    """make's variant, or a stand-in keeping why it could not be made (the others still run)."""
    try:
        return make(work, name, device)
    except Exception as error:
        return Variant(name, LABELS[work.kind][name], step=None, checks={"error": failure(error)})


def warmed(model: str, variant: Variant, clock: Clock, pace: Pace) -> bool:
    """Warm the variant up -> whether it ran; one that raised, now or when made, keeps its error
    and is left out, so the others are still measured."""
    if "error" in variant.checks:
        return False
    try:
        variant.warmup_steps = warm_up(variant, clock, pace)
    except Exception as error:
        variant.checks["error"] = failure(error)
        log(f"{model} {variant.label}: failed, left out: {variant.checks['error']}")
        return False
    log(f"{model} {variant.label}: warmed up in {variant.warmup_steps} steps")
    return True


def log(message: str) -> None:
    """Rank 0's progress, with the seconds since start: where a bounded run's time went."""
    if dist.get_rank() == 0:
        print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", flush=True)


def summary(work: Workload, variants: list) -> dict:
    """A model's results: per variant its median and floor, its ratios to the baselines it has,
    its target judged, its checks."""
    medians = {v.name: statistics.median(v.times) for v in variants if v.times}
    rows = {}
    for v in variants:
        if not v.times:
            rows[v.name] = {"label": v.label, **v.checks}
            continue
        rows[v.name] = {"label": v.label, "median_ms": medians[v.name], "floor_ms": min(v.times),
                        "timed_steps": len(v.times), "warmup_steps": v.warmup_steps,
                        "ratio": {base: medians[v.name] / medians[base] for base in ("none", "bf16")
                                  if base in medians and base != v.name},
                        "target": judged(work.name, v.name, medians, v.checks.get("profile")), **v.checks,
                        "schedule": v.compressor.schedule_report() if v.compressor is not None else None}
    return {"describe": work.describe, "parameters": sum(p.numel() for p in work.model.parameters()),
            "variants": rows}


def judged(model: str, variant: str, medians: dict, profile: Optional[dict]) -> Optional[dict]:
    """The variant's target (TARGETS) and whether its median met it (None: not judged, as no
    element went through codes in the profiled steps); None where it has no target here."""
    rule = TARGETS.get((model, variant))
    if rule is None or rule[0] not in medians:
        return None
    base, limit = rule
    ratio = medians[variant] / medians[base]
    if (profile or {}).get("coded_elements") == 0:
        return {"against": base, "limit": limit, "ratio": ratio, "met": None, "why": "no element went through codes"}
    return {"against": base, "limit": limit, "ratio": ratio, "met": ratio <= limit}


HEADER = (f"{'model':<11} {'variant':<14} {'median ms':>9} {'floor ms':>8} {'x none':>6} {'x bf16':>6} "
          f"{'target':<13} {'met':<3} | {'sync s/d/e':>14} {'memcpy':>7} {'D2H':>6} {'kernels':>7} {'buckets':>7} "
          f"{'sync/bkt':>8} {'coded M':>7} {'warn':>6} cupy")


def table_rows(model: str, result: dict) -> list:
    """The table's lines for one model."""
    if "error" in result:
        return [f"{model:<11} error: {result['error'][:ERROR_SHOWN]}"]
    return [row_line(model, row) for row in result["variants"].values()]


def row_line(model: str, row: dict) -> str:
    """One variant's line: its times, its ratios and its target, then its checks."""
    if "error" in row:
        return f"{model:<11} {row['label']:<14} error: {row['error'][:ERROR_SHOWN]}"
    prof, target = row.get("profile") or {}, row["target"]
    goal = f"<={target['limit']}x {target['against']}" if target else ""
    timing = (f"{model:<11} {row['label']:<14} {row['median_ms']:>9.2f} {row['floor_ms']:>8.2f} "
              f"{ratio(row, 'none'):>6} {ratio(row, 'bf16'):>6} {goal:<13} {MET[target['met']] if target else '':<3}")
    copies = prof["cudaMemcpyAsync"] + prof["cudaMemcpy"] if "cudaMemcpy" in prof else None
    checks = (f"{syncs(prof):>14} {number(copies):>7} {number(prof.get('d2h_copies')):>6} "
              f"{number(prof.get('kernels')):>7} {number(prof.get('buckets')):>7} {sync_per_bucket(prof):>8} "
              f"{millions(prof.get('coded_elements')):>7} "
              f"{number((row.get('sync_warnings') or {}).get('per_step')):>6} {cupy_verdict(row.get('cupy'))}")
    return f"{timing} | {checks}"


def ratio(row: dict, base: str) -> str:
    value = row["ratio"].get(base)
    return f"{value:.2f}" if value is not None else "-"


def number(value) -> str:
    return "-" if value is None else f"{value:.1f}" if value % 1 else f"{value:.0f}"


def millions(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def syncs(prof: dict) -> str:
    if "error" in prof or not prof:
        return "error" if prof else "-"
    return "/".join(number(prof[name]) for name in SYNC_CALLS)


def sync_per_bucket(prof: dict) -> str:
    value = prof.get("host_syncs_per_bucket")
    if value is None:
        return "-"
    return f"{value:.1f}{'' if value <= HOST_SYNCS_PER_BUCKET else '!'}"


def cupy_verdict(check: Optional[dict]) -> str:
    if not check:
        return "-"
    if "error" in check or not check.get("ran"):
        return "not run"
    return f"raised {check['type']}" if check["raised"] else "no sync"


def targets_line() -> str:
    """TARGETS and the synchronisation target, as the table's footnote."""
    rules = [f"{m} {v} <= {limit}x {base}" for (m, v), (base, limit) in TARGETS.items()]
    return ", ".join(rules + [f"host syncs per bucket <= {HOST_SYNCS_PER_BUCKET}"])


def environment(device, args) -> dict:
    """What the figures were measured on."""
    env = {"argv": sys.argv, "device": str(device), "world": dist.get_world_size(), "backend": dist.get_backend(),
           "torch": torch.__version__, "hvd_aps": hvd_aps.__version__, "pace": dataclasses.asdict(args.pace),
           "smoke": args.smoke, "targets": {f"{m}/{v}": {"against": b, "limit": lim} for (m, v), (b, lim) in
                                             TARGETS.items()},
           "host_syncs_per_bucket_target": HOST_SYNCS_PER_BUCKET, "cuda": torch.version.cuda,
           "ddp_bucket_cap_mb": DDP_BUCKET_MB}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        with contextlib.suppress(ImportError):
            import cupy
            env["cupy"] = cupy.__version__
    return env


def init(device_kind: str) -> torch.device:
    """The process group (torchrun's, or world 1 through a file store when run plainly) and this
    rank's device."""
    cuda = device_kind == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    options = {"device_id": device} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", **options)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="gpu_step_benchmark"), "store")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                **options)
    return device


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="none: DDP's allreduce / FSDP2 alone; bf16: torch's bf16_compress_hook (DDP only); "
                             "aps: hvd_aps with APSCompressor(e4m3)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few steps: a check that it runs")
    for field in dataclasses.fields(Pace):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=field.type,
                            help=f"{field.metadata['help']} (default {getattr(PACES[False], field.name)}, "
                                 f"{getattr(PACES[True], field.name)} with --smoke)")
    parser.add_argument("--out", default="step_benchmark.json")
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Pace) if getattr(args, f.name) is not None}
    args.pace = dataclasses.replace(PACES[args.smoke], **given)
    return args


def main():
    args = parse()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # a step cut off by timeout shows where
    device = init(args.device)
    rank = dist.get_rank()
    results = {"environment": environment(device, args), "models": {}}
    for name in args.models:
        try:
            results["models"][name] = measure_model(name, args.variants, args, device)
        except Exception as error:  # the next model may still run
            results["models"][name] = {"error": failure(error)}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print("\n".join([HEADER] + table_rows(name, results["models"][name])), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
    if rank == 0:
        print("\n" + "\n".join([HEADER] + [line for name, result in results["models"].items()
                                           for line in table_rows(name, result)]))
        print(f"targets: {targets_line()}; results in {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
