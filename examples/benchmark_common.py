"""What the synthetic benchmarks share: timing, the interface's tx counter, the codec speed that
examples/netns_cluster.py's performance model uses, and rank 0's JSON line."""
import collections
import dataclasses
import json
import os
import random
import statistics
import threading
import time
import timeit
from typing import Callable

import numpy as np

import hvd_aps


def tx_bytes(iface):
    if not iface:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def timed(fn, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def codec_gbps(params):
    """Round-trip speed of e4m3 over a gradient of `params` float32 values, GB/s of float32."""
    flat = np.random.default_rng(0).standard_normal(params).astype(np.float32)
    return 4 * params / statistics.median(timed(lambda: hvd_aps.quantize(flat, "e4m3"), 3)) / 1e9


PROFILES = ("mlp", "large", "resnet50", "tensors", "resnet18", "transformer", "lm")  # see synthetic_models.py


# warm-up steps at most while a compressor's schedule is still being chosen: the chunking's exchanges
# and every round of policy="auto"'s trials among codes, float32 and float16 (75 steps)
MAX_TUNING_STEPS = 100


def measure(step, args, phases, params, allgather_object, rank, size, compressor=None, extra=None):
    """Warm up (at least --num-warmup-batches steps, and until `compressor`'s run-time schedule has
    settled on every bucket), time args.num_iters steps, read the tx counter; rank 0 prints one
    JSON line (with the schedule chosen, and `extra`'s keys: of a callable, its value then).
    phases: compute-only seconds of the step's forward, backward and optimizer (or of the whole
    step, {"step": s}, where they cannot be told apart)."""
    measure_together([Variant(args.compression, step, compressor)], args, phases, params, allgather_object, rank,
                     size, extra)


@dataclasses.dataclass
class Variant:
    """One way to step in a job: its compression's name, its step and its APSCompressor (or None),
    and what its timed steps measured."""
    name: str
    step: Callable
    compressor: object = None
    times: list = dataclasses.field(default_factory=list)
    # CPU seconds a step of each timed block, every thread of the rank's process: the host's cost,
    # which a machine's other load moves far less than it moves the wall clock
    cpu: list = dataclasses.field(default_factory=list)
    cpu_threads: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # thread id -> seconds
    sent: int = 0   # bytes the interface sent during its timed steps
    codes: int = 0  # bytes its compressor counted meanwhile
    steps_run: int = 0  # before the timed ones
    timed_steps: int = 0

    def run_timed(self, args) -> None:
        """One harness block (a step, or Horovod's `timeit` over --num-batches-per-iter steps), its
        bytes counted."""
        threads_before = thread_cpu()  # first: its reads of /proc are not the step's CPU
        before, codes_before, cpu_before = tx_bytes(args.iface), self.codes_sent(), time.process_time()
        seconds, steps = HARNESSES[args.harness](self.step, args)
        self.cpu.append((time.process_time() - cpu_before) / steps)
        for tid, ran in thread_cpu().items():
            self.cpu_threads[tid] += ran - threads_before.get(tid, 0.0)
        self.times.append(seconds)
        self.sent += tx_bytes(args.iface) - before
        self.codes += self.codes_sent() - codes_before
        self.timed_steps += steps

    def codes_sent(self) -> int:
        return self.compressor.bytes_sent if self.compressor is not None else 0


def measure_together(variants, args, phases, params, allgather_object, rank, size, extra=None):
    """measure() for several variants in one job, each warmed up and settled in turn (its
    schedule's trials timing its own steps back to back), then their timed blocks alternated (in
    each order by turns), so the machine's speed, which moves between jobs by more than many of
    the differences measured, moves every variant alike; rank 0 prints a JSON line a variant."""
    for v in variants:
        timed(v.step, args.num_warmup_batches)
        # all of them: examples/profile_split.py --steps
        v.steps_run = args.num_warmup_batches + settle(v.step, v.compressor, allgather_object)
    learn_kinds()
    for k in range(args.num_iters):
        for v in variants if k % 2 == 0 else variants[::-1]:
            v.run_timed(args)
    codec = codec_gbps(params)
    for v in variants:
        # kinds summed once every thread had its chance to tell
        threads = {kind: ran / v.timed_steps for kind, ran in cpu_by_kind(v.cpu_threads).items()}
        per_rank = allgather_object({"step": statistics.median(v.times), "cpu": statistics.median(v.cpu),
                                     "threads": threads,
                                     "tx_bytes_per_step": v.sent / v.timed_steps,
                                     "codes": v.codes / v.timed_steps if v.compressor is not None else None,
                                     "phases": phases, "codec_gbps": codec})
        if rank == 0:
            print(json.dumps({"compression": v.name, "profile": args.profile, "ranks": size, "params": params,
                              "steps_run": v.steps_run + v.timed_steps, "harness": args.harness, "threads": args.threads,
                              "step_median": max(r["step"] for r in per_rank),
                              "cpu_per_step": statistics.mean(r["cpu"] for r in per_rank),
                              "cpu_threads_per_step": {kind: statistics.mean(r["threads"].get(kind, 0.0) for r in per_rank)
                                                       for kind in THREAD_KINDS},
                              "tx_bytes_per_step": statistics.mean(r["tx_bytes_per_step"] for r in per_rank),
                              "compute": statistics.median(sum(r["phases"].values()) for r in per_rank),
                              **{k: statistics.median(r["phases"][k] for r in per_rank) for k in phases},
                              "codec_gbps": statistics.median(r["codec_gbps"] for r in per_rank),
                              "codes_bytes_per_step": (statistics.mean(r["codes"] for r in per_rank)
                                                       if v.compressor is not None else None),
                              "schedule": v.compressor.schedule_report() if v.compressor is not None else None,
                              **({"same_job": [u.name for u in variants]} if len(variants) > 1 else {}),
                              **{k: e() if callable(e) else e for k, e in (extra or {}).items()}}), flush=True)


THREAD_KINDS = ("main", "exchange", "codec", "gloo", "horovod", "other")  # see thread_kind
TASKS = "/proc/self/task"  # Linux: a directory for each thread of this process
# Threads by name (hvd_aps names its own in the OS, torch's Gloo names its threads), first match
NAMED_KINDS = (("hvd_aps_codec", "codec"), ("hvd_aps", "exchange"), ("gloo", "gloo"), ("pt_gloo", "gloo"))
# The others by where Linux saw them wait (wchan): Gloo's event loops inside Horovod wait in
# epoll, Horovod's background loop sleeps between its negotiation cycles
WAIT_KINDS = {"do_epoll_wait": "gloo", "ep_poll": "gloo", "hrtimer_nanosleep": "horovod"}
_kinds = {}  # thread id -> its kind, once its name or one of its waits told it
LEARN_SECONDS = 0.5  # learn_kinds: how long it reads every thread's wait
LEARN_INTERVAL = 1e-3  # its mean interval between reads, drawn anew each time to fall out of step
                       # with Horovod's 1 ms cycle


def thread_cpu() -> dict:
    """{thread id: CPU seconds it has run} of this process's threads, from Linux's schedstat
    (nanoseconds; {} where there is none); each read also looks at what each thread waits in, for
    thread_kind."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    main, out = threading.main_thread().native_id, {}
    for tid in os.listdir(TASKS) if os.path.isdir(TASKS) else ():
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
            _learn_kind(int(tid), main, named.get(int(tid)))
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out


def _learn_kind(tid: int, main: int, python_name) -> None:
    if tid in _kinds:
        return
    if tid == main:
        _kinds[tid] = "main"
        return
    name = python_name
    if name is None:  # a thread Python did not start: its name in the OS
        with open(f"{TASKS}/{tid}/comm") as f:
            name = f.read().strip()
    kind = next((k for prefix, k in NAMED_KINDS if name.startswith(prefix)), None)
    if kind is None:
        with open(f"{TASKS}/{tid}/wchan") as f:
            kind = WAIT_KINDS.get(f.read().strip())
    if kind is not None:
        _kinds[tid] = kind


def learn_kinds(seconds: float = LEARN_SECONDS) -> None:
    """Look at every thread's wait about every millisecond for `seconds`, before a measurement:
    Horovod's background loop spends most of a cycle in its collective and only a small part in
    the sleep that tells it, so the reads around timed steps alone can miss it."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        thread_cpu()
        time.sleep(random.uniform(0.5, 1.5) * LEARN_INTERVAL)


def cpu_by_kind(cpu_by_thread: dict) -> collections.Counter:
    """{thread id: CPU seconds} summed by thread_kind."""
    by_kind = collections.Counter()
    for tid, ran in cpu_by_thread.items():
        by_kind[thread_kind(tid)] += ran
    return by_kind


def thread_kind(tid: int) -> str:
    """A thread's kind: the main thread (forward, backward and the framework's hooks, Horovod's
    compress() and synchronize()), hvd_aps's exchange threads (its lanes, the DDP hook's), its
    codec pool, Gloo's threads (torch's by name, Horovod's event loops by their epoll wait),
    Horovod's background loop (by its sleep between cycles) and every other thread (torch's
    intra-op workers, OpenBLAS's, a Horovod thread never seen in its wait)."""
    return _kinds.get(tid, "other")


def settle(step, compressor, allgather_object) -> int:
    """Step until `compressor`'s run-time schedule (None: there is none) has decided every bucket
    on every rank, at most MAX_TUNING_STEPS times -> the steps run."""
    for steps in range(MAX_TUNING_STEPS):
        if all(allgather_object(compressor is None or all(row["chosen"] for row in compressor.schedule_report()))):
            return steps  # every rank steps alike
        step()
    return MAX_TUNING_STEPS


def horovod_harness(step, args):
    """Horovod's own synthetic-benchmark loop, one iteration: `timeit` over --num-batches-per-iter
    steps -> (seconds per step, steps run)."""
    n = args.num_batches_per_iter
    return timeit.timeit(step, number=n) / n, n


HARNESSES = {"steps": lambda step, args: (timed(step, 1)[0], 1), "horovod": horovod_harness}
HIERARCHICAL = {"auto": None, "on": True, "off": False}


def compressor_options(args):
    """APSCompressor keywords from the command line: stats (off unless --stats: a sampled pass),
    chunk_bytes, bucket_bytes, min_elements, hierarchical."""
    options = {"stats": args.stats, "hierarchical": HIERARCHICAL[args.hierarchical]}
    given = {"chunk_bytes": args.chunk_bytes, "bucket_bytes": args.bucket_bytes, "min_elements": args.min_elements}
    return {**options, **{k: v for k, v in given.items() if v is not None}}


def add_arguments(parser):
    parser.add_argument("--compression", default="none")
    parser.add_argument("--profile", choices=PROFILES, default="mlp",
                        help="mlp (4 x hidden^2), large (two 8.4M layers), resnet50 (161 tensors, no real compute), "
                             "resnet18, transformer and lm (real compute); see synthetic_models.py")
    parser.add_argument("--hidden", type=int, default=2048,
                        help="mlp: 4 x hidden^2 parameters (2048: 16.8M); transformer: the width")
    parser.add_argument("--blocks", type=int, default=6, help="transformer: blocks")
    parser.add_argument("--tensors", type=int, default=300, help="tensors: how many")
    parser.add_argument("--tensor-elements", type=int, default=20_000, help="tensors: elements in each")
    parser.add_argument("--vocab", type=int, default=16384, help="lm: tokens in the embedding and the LM head")
    parser.add_argument("--image-size", type=int, default=112, help="resnet18: square images of this side")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads per rank (default 0: the framework's own choice)")
    parser.add_argument("--harness", choices=sorted(HARNESSES), default="steps",
                        help="steps: each step timed alone; horovod: Horovod's benchmark loop (timeit over "
                             "--num-batches-per-iter steps, --num-iters times)")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="--harness horovod: steps per timeit")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chunk-bytes", type=lambda v: v if v == "auto" else int(v),
                        help="APSCompressor's chunk_bytes (0: no pipelining; default auto: tuned at run time)")
    parser.add_argument("--bucket-bytes", type=int,
                        help="APSCompressor's bucket_bytes (default: its own, 16 MiB of float32 a bucket)")
    parser.add_argument("--min-elements", type=int,
                        help="APSCompressor's min_elements: smaller tensors go through the framework's own allreduce "
                             "(default: its own, 4096)")
    parser.add_argument("--hierarchical", choices=sorted(HIERARCHICAL), default="auto",
                        help="APSCompressor's hierarchical: auto (two levels where hosts hold several ranks), on, off")
    parser.add_argument("--stats", action="store_true",
                        help="APSCompressor's per-tensor stats on (its default; off here to time the exchange alone)")
    parser.add_argument("--dynamic-process-sets", action="store_true",
                        help="Horovod: hvd.init(process_sets='dynamic') (default: a plain hvd.init())")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=8)
    parser.add_argument("--iface", default="", help="network interface whose tx counter to read")
