"""Synthetic data-parallel benchmark in the style of Horovod's pytorch_synthetic_benchmark.py, on a
communication-bound model (an MLP of --hidden width: 4 x hidden^2 parameters, little compute).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py --compression aps-e4m3

--compression: none | fp16 (Horovod's own) | aps-<fmt> (the card's line: APSCompressor on Horovod's
optimizer, codes on the wire) | aps-<fmt>-values (the same rounding, float16 values on the wire) |
codes-<fmt> (hvd_aps.torch.DistributedOptimizer, codes in buckets fixed at construction).
Rank 0 prints one JSON line: median step time, this job's per-rank bytes sent on --iface during the
timed steps (from the interface counters), the compute-only step time and the codec throughput
that the performance model in examples/netns_cluster.py uses.
"""
import argparse
import json
import statistics
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

import hvd_aps
import hvd_aps.torch
from hvd_aps import from_name


def tx_bytes(iface):
    if not iface:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def mlp(hidden):
    return torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())])


def step_fn(model, opt, x, y):
    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return step


def timed(fn, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def wrap(opt, model, compression):
    comp = from_name(compression, hvd.Compression)
    if isinstance(comp, hvd_aps.APSCompressor):
        comp.collect_stats = False
    if compression.startswith("codes-"):
        return hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="none")
    parser.add_argument("--hidden", type=int, default=2048, help="4 x hidden^2 parameters (2048: 16.8M)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=8)
    parser.add_argument("--iface", default="", help="network interface whose tx counter to read")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp(args.hidden)
    params = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(args.batch_size, args.hidden), torch.randn(args.batch_size, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    compute = statistics.median(timed(step_fn(model, opt, x, y), 3))  # no communication yet
    flat = np.random.default_rng(0).standard_normal(params).astype(np.float32)
    codec = 4 * params / statistics.median(timed(lambda: hvd_aps.quantize(flat, "e4m3"), 3))

    opt = wrap(opt, model, args.compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step = step_fn(model, opt, x, y)
    timed(step, args.num_warmup_batches)
    before = tx_bytes(args.iface)
    times = timed(step, args.num_iters)
    sent = (tx_bytes(args.iface) - before) / args.num_iters
    per_rank = hvd.allgather_object({"step": statistics.median(times), "tx_bytes_per_step": sent,
                                     "compute": compute, "codec_gbps": codec / 1e9})
    if hvd.rank() == 0:
        print(json.dumps({"compression": args.compression, "ranks": hvd.size(), "params": params,
                          "step_median": max(r["step"] for r in per_rank),
                          "tx_bytes_per_step": statistics.mean(r["tx_bytes_per_step"] for r in per_rank),
                          "compute": statistics.median(r["compute"] for r in per_rank),
                          "codec_gbps": statistics.median(r["codec_gbps"] for r in per_rank)}), flush=True)


if __name__ == "__main__":
    main()
