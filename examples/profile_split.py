"""Where a rank's time goes, from a py-spy profile: every sample (py-spy record --idle -f raw) put in
one category by the frames on its stack, per thread kind, as shares of the run.

    horovodrun -np 2 -H localhost:2 --gloo py-spy record --idle -r 250 -f raw -o prof.txt -- \\
        python examples/pytorch_synthetic_benchmark.py --profile resnet18 --batch-size 2 --compression aps-e4m3
    python examples/profile_split.py prof.txt

Categories (the first that matches, innermost frames first): the codec (hvd_aps.codec's engine
calls), waiting for a collective or a result (polling, sleeping, futures, Horovod's synchronize,
Gloo's wait), Horovod's own calls (enqueueing, negotiation), the exchange's Python stages (the
rest of hvd_aps), backward, forward, the optimizer, and other.
"""
import argparse
import collections
import re

CATEGORIES = [  # (name, frame patterns), first match wins
    ("codec", ("encode_into", "sum_rows", "decode_row", "amax", "hvd_encode", "decode_table", "quantize")),
    ("waiting", ("Condition.wait", "sleep", "wait (", "synchronize", "Future.result", "poll", "_worker", "select",
                 "Event.wait", "Barrier")),
    ("Horovod calls", ("horovod/",)),
    ("exchange stages (Python)", ("hvd_aps/",)),
    ("backward", ("_engine_run_backward", "backward")),
    ("forward", ("forward", "_conv_forward", "linear")),
    ("optimizer", ("sgd", "step (torch/optim", "_single_tensor")),
]


def category(frames):
    for name, patterns in CATEGORIES:
        for frame in reversed(frames):
            if any(p in frame for p in patterns):
                return name
    return "other"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    args = parser.parse_args()
    counts = collections.defaultdict(collections.Counter)
    for line in open(args.profile):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"\(\d+\)|_\d+$|\d+", "", frames[0].split(":")[-1]).strip() or "thread"
        counts[thread][category(frames[1:])] += int(count)
    for thread, counter in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counter.values())
        print(f"{thread} ({total} samples)")
        for name, n in counter.most_common():
            print(f"  {name:28s} {100 * n / total:5.1f} %")


if __name__ == "__main__":
    main()
