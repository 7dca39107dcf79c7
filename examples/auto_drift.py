"""policy="auto" when the machine or the link changes under a running job: two netns hosts start
at --start-rate (codes win there), and once the run has kept codes and their steps have settled,
--change load starts --hogs processes that keep a core busy each (another job landing on the
machine), or --change link changes the links to --then-rate (uncapped by default: there the
framework's float32 allreduce is the faster), or --change none marks the same step and changes
nothing (how often the watch re-checks a job that did not change). The job: hvd_aps.torch.DistributedOptimizer with
APSCompressor(policy="auto") on --tensors vectors of --tensor-elements (examples/synthetic_models.py's
`tensors` profile), under Horovod's rendezvous as horovodrun starts it (examples/netns_cluster.py).
Prints the median step in each stretch: codes before the change, codes after it until every path
is timed again, the trials, and what was decided then. Needs root (ip netns, tc).

    sudo .venv/bin/python examples/auto_drift.py [--change load] [--hogs 2] [--start-rate 500mbit] [--json out.json]
    sudo .venv/bin/python examples/auto_drift.py --change link [--then-rate none]

All traffic stays inside the namespaces netns_cluster makes; they are removed at the end.
"""
import argparse
import contextlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from hvd_aps._schedule import DRIFT_WINDOW

SETTLED, CHANGED = "settled", "changed"  # in the run's folder: codes kept and settled (rank 0); the link changed
MARK_AFTER = 5  # steps past the settled window (the first DRIFT_WINDOW codes steps) before the change
CHANGE_S = 600  # the most the driver waits for the mark before it gives up on the change
KILL_S = 10  # a killed busy process's exit
JOIN_S = 4 * 30  # the change's own bound: four tc commands of netns_cluster.COMMAND_S each
HOG = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass"  # a busy core


def worker(args):
    """One rank: train until the decision after the change has held for --after steps (at most
    --max-steps); rank 0 marks the folder once codes have settled, and prints the run."""
    import horovod.torch as hvd
    import torch

    import hvd_aps
    import hvd_aps.torch
    from synthetic_models import Shaped

    hvd.init()
    torch.manual_seed(0)
    model = Shaped([(args.tensor_elements,)] * args.tensors)
    compressor = hvd_aps.APSCompressor("e4m3", policy="auto")
    opt = hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters(), compression=compressor)
    x = torch.ones(1, 1)
    steps, began, policies, kept, watched = [], [], [], None, []
    folder = pathlib.Path(args.out)
    for step in range(args.max_steps):  # the decisions, alike on every rank, end it at the same step
        began.append(time.time())
        started = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        steps.append(time.perf_counter() - started)
        policies.append(compressor.decisions()["policy"])
        kept = step if kept is None and policies[-1] == "codes" else kept
        if kept is not None and policies[-1] == "codes" and (step - kept) % DRIFT_WINDOW == 0:
            watched.append([step, compressor.schedule_report()[-1]["seconds"]])
        if hvd.rank() == 0 and kept is not None and step == kept + DRIFT_WINDOW + MARK_AFTER:
            (folder / SETTLED).touch()
        if _decided_again(policies, kept, args.after):
            break
    if hvd.rank() == 0:
        changed = float((folder / CHANGED).read_text()) if (folder / CHANGED).exists() else None
        print(json.dumps({"steps": steps, "policies": policies, "kept": kept,
                          "changed": next((k for k, t in enumerate(began) if changed and t >= changed), None),
                          "report": compressor.schedule_report(), "watched": watched}), flush=True)
    compressor.close()
    hvd.shutdown()


def _end(process) -> None:
    process.kill()
    process.wait(timeout=KILL_S)


def _boundaries(policies, kept):
    """(the step whose commit started the trials again after codes were kept at step `kept`, the
    step whose commit decided again): policies[k] is what step k's commit left, so the steps
    after each of them run the new way (len(policies) where it has not come)."""
    end = len(policies)
    again = next((k for k in range(kept, end) if policies[k] is None), end) if kept is not None else end
    return again, next((k for k in range(again, end) if policies[k] is not None), end)


def _decided_again(policies, kept, after):
    """Whether the trials ran again after codes were kept and `after` steps have run since the new decision."""
    _, decided = _boundaries(policies, kept)
    return len(policies) - 1 - decided >= after


def stretches(run):
    """(name, first step, steps, median seconds) of the run's stretches around the change."""
    policies, steps, kept, changed = run["policies"], run["steps"], run["kept"], run["changed"]
    again, decided = _boundaries(policies, kept)
    end = len(policies)
    parts = [("codes kept, before the change", kept + 1, changed),
             ("codes kept, after the change", changed, again + 1),
             ("timing every path again", again + 1, decided + 1),
             (f"decided again: {policies[decided] if decided < end else None}", decided + 1, end)]
    return [(name, a, max(0, b - a), statistics.median(steps[a:b]) if b > a else None) for name, a, b in parts]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", choices=["load", "link", "none"], default="load",
                        help="what changes once codes settled")
    parser.add_argument("--start-rate", default="500mbit", help="the links' tc rate at the start")
    parser.add_argument("--then-rate", default="none", help="--change link: the links' rate then (none: uncapped)")
    parser.add_argument("--hogs", type=int, default=2, help="--change load: processes keeping a core busy each")
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--tensor-elements", type=int, default=10_000)
    parser.add_argument("--after", type=int, default=60, help="steps the decision after the change is kept for")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the job")
    parser.add_argument("--json", help="also write the run here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.out = args.worker
        return worker(args)
    import netns_cluster
    with tempfile.TemporaryDirectory() as out, netns_cluster.cluster(2, args.start_rate) as names, \
            contextlib.ExitStack() as hogs:
        changed, stop, failed, started = threading.Event(), threading.Event(), [], time.monotonic()
        print(f"2 hosts at {args.start_rate}: training until policy='auto' keeps codes", flush=True)

        def change():
            mark = pathlib.Path(out) / SETTLED
            deadline = time.monotonic() + CHANGE_S
            while not mark.exists() and not stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not mark.exists() or stop.is_set():
                return
            if args.change == "link":
                for host in range(len(names)):
                    netns_cluster.cap(host, None if args.then_rate == "none" else args.then_rate, change=True)
            for _ in range(args.hogs if args.change == "load" else 0):  # each killed with the job, or ends at its bound
                hog = subprocess.Popen([sys.executable, "-c", HOG.format(seconds=args.timeout)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                hogs.callback(_end, hog)
            (pathlib.Path(out) / CHANGED).write_text(str(time.time()))
            changed.set()
            print(f"[{time.monotonic() - started:.0f} s] codes kept and settled: "
                  + {"link": f"links now {args.then_rate}", "load": f"{args.hogs} busy processes started",
                     "none": "nothing changed"}[args.change],
                  flush=True)

        def changing():
            try:
                change()
            except Exception as error:  # surfaced once the job has ended
                failed.append(error)
        thread = threading.Thread(target=changing, daemon=True)
        thread.start()
        argv = [str(pathlib.Path(__file__).resolve()), "--worker", out, "--tensors", str(args.tensors),
                "--tensor-elements", str(args.tensor_elements), "--after", str(args.after),
                "--max-steps", str(args.max_steps)]
        try:
            run = netns_cluster.launch(names, 1, argv, args.timeout, label="auto_drift")[0]
        finally:
            stop.set()
            thread.join(JOIN_S)  # before the busy processes are killed and the namespaces removed
    if failed:
        raise RuntimeError(f"changing the {args.change} failed") from failed[0]
    if not changed.is_set() or run["changed"] is None:
        sys.exit(f"codes were never kept at {args.start_rate} (decisions: {sorted(set(map(str, run['policies'])))}): "
                 "nothing to change under them")
    then = {"link": args.then_rate, "load": f"{args.hogs} processes busy beside the ranks",
            "none": "nothing changed"}[args.change]
    print(f"{args.tensors} tensors of {args.tensor_elements}, 2 hosts at {args.start_rate}; then {then}")
    for name, first, count, median in stretches(run):
        print(f"  {name:40s} from step {first:5d}: {count:4d} steps, median "
              + (f"{1e3 * median:7.1f} ms" if median is not None else "      -"))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(run | {"args": vars(args)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
