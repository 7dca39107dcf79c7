"""What DDP's step costs once policy="auto" settled on the framework's own allreduce, against DDP
with no comm hook and with torch's own `allreduce_hook` (any Python hook, and DDP takes one for
good). Run under torchrun; rank 0 prints the median step of each, after warm-up.

    torchrun --nproc-per-node 2 examples/ddp_native_overhead.py --hidden 2048 --repeats 3
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import hvd_aps
import hvd_aps.ddp

VARIANTS = ("no hook", "torch allreduce_hook", "aps_hook, native")


def step_time(variant: str, args) -> float:
    """Median seconds of args.steps timed steps (after args.warmup) with this comm hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2 * args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 2 * args.hidden))
    ddp, state = DistributedDataParallel(model), None
    if variant == VARIANTS[1]:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == VARIANTS[2]:
        compressor = hvd_aps.APSCompressor("e4m3", policy="auto")
        compressor.pin({"policy": "native"})  # as if its trials had settled on DDP's allreduce
        state = hvd_aps.ddp.APSState(compressor)
        ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch_size, 2 * args.hidden)
    times = []
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        times.append(time.perf_counter() - started)
    if state is not None:
        state.close()
    return statistics.median(times[args.warmup:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048, help="two Linear layers of 2 x hidden^2 parameters")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the three variants")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            results[v].append(step_time(v, args))
    if dist.get_rank() == 0:
        base = statistics.median(results[VARIANTS[0]])
        for v, runs in results.items():
            print(f"{v:>22}: median {statistics.median(runs):.4f} s (runs {' '.join(f'{t:.4f}' for t in runs)}), "
                  f"x no hook {statistics.median(runs) / base:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
