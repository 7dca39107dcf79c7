"""The CPU an idle Horovod rank uses: nothing queued, only its loops cycling. Horovod's background
loop runs a cycle every HOROVOD_CYCLE_TIME milliseconds (1 by default) and each cycle agrees with
the other ranks on what is ready through a collective of its own, whether or not anything was
enqueued; on cores the ranks share, that CPU comes out of every step in proportion to the step's
length. Each rank measures its threads by kind (benchmark_common.thread_kind) over `--seconds`
and rank 0 prints one JSON line a rank, in CPU milliseconds a second of wall time:

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_idle_cpu.py
    HOROVOD_CYCLE_TIME=3 horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_idle_cpu.py
"""
import argparse
import json
import os
import time

import horovod.torch as hvd
import torch

from benchmark_common import cpu_by_kind, learn_kinds, thread_cpu


def idle_cpu(seconds: float) -> dict:
    """{kind of thread: CPU ms a second} of this process over `seconds` of doing nothing, and "all"."""
    learn_kinds()  # before: its reads are not the idle rank's CPU
    start, began = thread_cpu(), time.perf_counter()
    time.sleep(seconds)
    end, wall = thread_cpu(), time.perf_counter() - began
    by_kind = cpu_by_kind({tid: cpu - start.get(tid, 0.0) for tid, cpu in end.items()})
    by_kind["all"] = sum(by_kind.values())
    return {kind: round(1e3 * cpu / wall, 2) for kind, cpu in by_kind.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each rank idles, measured")
    args = parser.parse_args()
    hvd.init()
    hvd.allreduce(torch.ones(1), name="idle_cpu.start")  # every rank's loops up and connected
    mine = {"rank": hvd.rank(), "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME", "1 (default)"),
            "cpu_ms_per_s": idle_cpu(args.seconds)}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        for line in every:
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
