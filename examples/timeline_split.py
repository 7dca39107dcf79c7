"""Where Horovod's background thread spends a step, from a Horovod timeline (rank 0 writes it where
HOROVOD_TIMELINE names a file): per kind of collective, how many a step, the time its requests
waited in negotiation (from the first rank's request until every rank had asked and Horovod's
cycle answered) and the time it ran, each as the time one or more of the kind was at it, and the
same for the runs of every kind (the thread busy moving data).

    HOROVOD_TIMELINE=/tmp/timeline.json horovodrun -np 2 -H localhost:2 --gloo \\
        python examples/pytorch_synthetic_benchmark.py --profile tensors --tensors 400 \\
        --tensor-elements 10000 --batch-size 1 --compression aps-e4m3 --num-warmup-batches 30
    python examples/timeline_split.py /tmp/timeline.json --seconds 1.5

Only the last --seconds of the timeline are read (the timed steps; the benchmark's closing
allgather_object of its results left out). A step is one allreduce of every gradient (Horovod's
optimizer names them by parameter): the steps in the window are the most times one name ran there.
Kinds: the codes' metadata allreduce (hvd_aps.*.meta), their alltoalls (codes*) and allgathers
(shards*), every other allreduce (the gradients' own, or with APSCompressor the tokens it hands
Horovod in their place), and Horovod's allgather_object (dict.*).
"""
import argparse
import collections
import json

OPS = ("ALLREDUCE", "ALLGATHER", "ALLTOALL", "BROADCAST", "REDUCESCATTER")


def load(path: str) -> list:
    """The timeline's events (a file Horovod is still writing lacks its closing bracket)."""
    text = open(path).read().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def spans(events: list) -> list:
    """(start us, end us, tensor name, activity) of every top-level activity of every tensor."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    open_, out = collections.defaultdict(list), []
    for e in events:
        if e.get("ph") == "B":
            open_[e["pid"]].append(e)
        elif e.get("ph") == "E" and open_[e["pid"]]:
            begin = open_[e["pid"]].pop()
            if not open_[e["pid"]]:  # top level: negotiation, or the op as a whole
                out.append((begin["ts"], e["ts"], names.get(e["pid"], str(e["pid"])), begin["name"]))
    return out


def kind(name: str) -> str:
    op, _, tensor = name.partition(".")
    if tensor.startswith("hvd_aps."):
        last = tensor.rsplit(".", 1)[-1]
        return ("codes metadata" if last == "meta" else "codes alltoall" if last.startswith("codes")
                else "codes allgather" if last.startswith("shards") else f"hvd_aps {op}")
    return "allgather_object" if tensor.startswith("dict.") else f"other {op}"


def union_us(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("--seconds", type=float, default=1.5, help="the timeline's last seconds to read")
    args = parser.parse_args()
    all_spans = spans(load(args.timeline))
    last = max(end for _, end, name, _ in all_spans if kind(name) != "allgather_object")
    window = [s for s in all_spans if s[0] >= last - 1e6 * args.seconds and kind(s[2]) != "allgather_object"]
    runs = collections.Counter(name for _, _, name, activity in window if activity in OPS)
    steps = max(runs[name] for name in runs if kind(name) == "other allreduce")
    table = collections.defaultdict(lambda: ([], []))  # kind -> (negotiations, runs)
    for start, end, name, activity in window:
        if activity.startswith("NEGOTIATE") or activity in OPS:
            table[kind(name)][activity in OPS].append((start, end))
    print(f"{steps} steps in the last {args.seconds} s; per step (ms: while one or more of the kind was)")
    print(f"  {'kind':18s} {'count':>7s} {'negotiating ms':>15s} {'running ms':>11s}")
    for name, (negotiating, running) in sorted(table.items()):
        print(f"  {name:18s} {len(running) / steps:7.1f} {union_us(negotiating) / steps / 1e3:15.2f} "
              f"{union_us(running) / steps / 1e3:11.2f}")
    busy = union_us([(s, e) for s, e, _, activity in window if activity in OPS])
    print(f"  the background thread running any of them: {busy / steps / 1e3:.2f} ms a step")


if __name__ == "__main__":
    main()
