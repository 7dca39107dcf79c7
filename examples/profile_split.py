"""Where a training step's time goes, from a py-spy profile of one rank: the main thread's timed
steps and the exchange threads' work, each sample put in one category by the frames on its stack,
as milliseconds per step.

    horovodrun -np 2 -H localhost:2 --gloo py-spy record --idle --threads -r 200 -f raw -o prof.txt -- \\
        python examples/pytorch_synthetic_benchmark.py --profile resnet18 --batch-size 2 \\
        --compression aps-e4m3 --stats --num-iters 30
    python examples/profile_split.py prof.txt --rate 200 --steps 39   # the JSON line's steps_run

(one file per rank: run py-spy through a wrapper that names it by $HOROVOD_RANK or $RANK.)
--gradients N (the gradients a step hands Horovod): the main thread's time inside Horovod's
per-gradient calls as well, per step and per gradient (INCLUSIVE: compress(), decompress() and its
wait for the exchange, Horovod's enqueueing of what compress() returned and its synchronize());
with --gil PROFILE, a second profile of the same run recorded with py-spy's --gil (only samples
holding the interpreter), the share of each of those where the main thread held it.
--steps: the steps the main thread ran (the benchmark's JSON line says: steps_run, the warm-up's,
the schedule's tuning and the timed ones). Main thread, first match wins: waiting for the
exchange (a future's result, Horovod's synchronize or poll, a sleep), hvd_aps's Python
(compress/decompress, hooks), Horovod's Python (its hooks, enqueueing), backward (torch's engine),
the optimizer, forward, other. Exchange threads (hvd_aps_*, the DDP lanes), idle time in their
pool left out: the codec (the engine's calls, GIL released), waiting for a collective (a blocking
torch.distributed call included), Horovod's Python, the exchange's own Python stages, other.
"""
import argparse
import collections
import re

STEP_FRAME = "step_fn.<locals>.step (synthetic_models.py"  # a step, whatever harness times it
MAIN = [  # (category, frame patterns): the innermost frame that matches decides
    ("waiting for the exchange", ("Future.result", "Condition.wait", "synchronize (horovod", "poll (horovod",
                                  "wait (hvd_aps", "sleep")),
    ("hvd_aps Python", ("hvd_aps/",)),
    ("Horovod Python", ("horovod/",)),
    ("backward", ("_engine_run_backward",)),
    ("optimizer", ("torch/optim/",)),
    ("forward", ("forward (", "_call_impl")),
]
WORKER = [
    ("codec", ("table_", "amax", "quantize", "_host_engine", "_numpy_engine")),
    ("waiting for a collective", ("wait (", "poll", "sleep", "Condition.wait", "synchronize", "Work.wait",
                                  "torch/distributed/")),  # blocking torch.distributed calls wait inside
    ("Horovod Python", ("horovod/",)),
    ("exchange stages (Python)", ("hvd_aps/",)),
]
# (what, pattern groups): a main-thread sample counts where a frame matches each group
INCLUSIVE = [
    ("compress()", (("Compressor.compress (",),)),  # APSCompressor's, or Horovod's own compressors'
    ("decompress()", (("Compressor.decompress (",),)),
    ("  waiting for the exchange", (("Compressor.decompress (",), ("Future.result", "Condition.wait"))),
    ("Horovod's enqueueing", (("allreduce_async_ (horovod", "grouped_allreduce_async_ (horovod"),)),
    ("Horovod's synchronize()", (("synchronize (horovod/torch/mpi_ops",),)),
    ("backward", (("_engine_run_backward",),)),
]
IDLE = "_worker (concurrent/futures/thread.py"  # innermost: a pool thread with nothing to do
EXCHANGE_THREADS = re.compile(r"hvd_aps")


def category(frames, table):
    for frame in reversed(frames):
        for name, patterns in table:
            if any(p in frame for p in patterns):
                return name
    return "other"


def split(lines):
    """-> {thread kind: Counter(category -> samples)} over the main thread's steps and the
    exchange threads' work."""
    counts = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(":", 1)[-1].strip()
        if thread == "MainThread":
            if any(STEP_FRAME in f for f in frames):
                counts["main thread"][category(frames[1:], MAIN)] += int(count)
        elif EXCHANGE_THREADS.search(thread):
            if frames[-1].startswith(IDLE):
                continue
            counts["exchange threads"][category(frames[1:], WORKER)] += int(count)
    return counts


def inclusive(lines) -> collections.Counter:
    """The main thread's step samples inside each INCLUSIVE row."""
    counts = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if frames[0].split(":", 1)[-1].strip() != "MainThread" or not any(STEP_FRAME in f for f in frames):
            continue
        for name, groups in INCLUSIVE:
            if all(any(p in f for f in frames for p in group) for group in groups):
                counts[name] += int(count)
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--rate", type=float, default=200, help="py-spy's samples per second (-r)")
    parser.add_argument("--steps", type=int, required=True, help="steps run inside benchmark_common.timed")
    parser.add_argument("--gradients", type=int, help="gradients a step: Horovod's per-gradient calls too")
    parser.add_argument("--gil", help="a profile of the same run recorded with py-spy's --gil")
    args = parser.parse_args()
    counts = split(open(args.profile))
    for thread in ("main thread", "exchange threads"):
        counter = counts.get(thread, collections.Counter())
        total = sum(counter.values())
        print(f"{thread}: {1e3 * total / args.rate / args.steps:.1f} ms a step")
        for name, n in counter.most_common():
            print(f"  {name:28s} {1e3 * n / args.rate / args.steps:7.1f} ms")
    if args.gradients:
        inside, held = inclusive(open(args.profile)), inclusive(open(args.gil)) if args.gil else None
        print(f"main thread inside, per step and per gradient ({args.gradients} a step)"
              + (", and the share holding the interpreter" if held is not None else ""))
        for name, _ in INCLUSIVE:
            ms = 1e3 * inside[name] / args.rate / args.steps
            share = f" {held[name] / inside[name]:6.0%}" if held is not None and inside[name] else ""
            print(f"  {name:28s} {ms:7.1f} ms {1e3 * ms / args.gradients:7.1f} us{share}")


if __name__ == "__main__":
    main()
