"""The codes exchange's cost as a table: the emulator runs N workers' exchanges in one process (the
driver real ranks run, on one thread per worker: hvd_aps.emulate.codes_allreduce), so its time
divided by N is one rank's codec (and Python) time per step (on the CPU the process's CPU time,
which waits at the collectives do not count; on a GPU the wall time, every worker's kernels on
one device one after another); beside it, the wire time one rank's codes and bf16 values need
at a few link speeds, and the link speed below which codes pay.

    python examples/benchmark_exchange.py [--model resnet50|transformer-1b] [--workers 8] [--device cpu|cuda]

resnet50: ResNet-50's 161 tensor shapes (25.6M parameters); transformer-1b: 24 blocks of width 2048
(1.2B parameters: at 8 workers it needs ~40 GB of float32 on the device). Gradients are Gaussian,
random per worker. The emulator keeps every worker's buffers: memory grows with --workers.
"""
import argparse
import statistics
import time

import numpy as np

import hvd_aps
from hvd_aps import emulate
from hvd_aps._layout import buckets

RATES_GBIT = (25, 100, 400)


def shapes(model):
    if model == "resnet50":
        from synthetic_models import resnet50_shapes
        return resnet50_shapes()
    width, blocks = 2048, 24  # a transformer block: qkv, proj, two MLP layers, biases, two LayerNorms
    block = [(3 * width, width), (3 * width,), (width, width), (width,), (4 * width, width), (4 * width,),
             (width, 4 * width), (width,), (width,), (width,), (width,), (width,)]
    return block * blocks + [(50_000, width)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "transformer-1b"], default="resnet50")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--formats", default="e4m3,e3m0")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    if args.device == "cuda":
        import cupy as xp
        sync, clock = xp.cuda.Device().synchronize, time.perf_counter
    else:
        xp, sync, clock = np, (lambda: None), time.process_time
    sizes = [int(np.prod(s)) for s in shapes(args.model)]
    params = sum(sizes)
    rng = np.random.default_rng(0)
    grads = [[xp.asarray((rng.standard_normal(n) * 1e-3).astype(np.float32)) for n in sizes]
             for _ in range(args.workers)]
    print(f"{args.model}: {params / 1e6:.1f}M parameters in {len(sizes)} tensors, {args.workers} emulated workers "
          f"on {args.device}; one bucket per run of bucket_bytes, median of {args.repeats}")
    header = f"{'format':>8} {'codec ms/rank':>14}" + "".join(f" {f'{r}G codes ms':>13} {f'{r}G bf16 ms':>12}"
                                                               for r in RATES_GBIT) + f" {'codes pay below':>16}"
    print(header)
    ring = 2 * (args.workers - 1) / args.workers
    for name in args.formats.split(","):
        fmt = hvd_aps.FloatFormat.parse(name)
        compressors = [hvd_aps.APSCompressor(fmt, stats=False, chunk_bytes=0) for _ in range(args.workers)]
        groups, _ = buckets(sizes, compressors[0].config.bucket_bytes, 0)
        times = []
        for _ in range(args.repeats + 1):  # the first run allocates
            sync()
            start = clock()
            for b, group in enumerate(groups):
                emulate.codes_allreduce(compressors, [[g[i] for i in group] for g in grads], name=f"b{b}")
            sync()
            times.append(clock() - start)
        codec = statistics.median(times[1:]) / args.workers
        codes_bytes, bf16_bytes = ring * params * fmt.bits / 8, ring * params * 2
        cells = "".join(f" {1e3 * codes_bytes * 8 / (r * 1e9):13.2f} {1e3 * bf16_bytes * 8 / (r * 1e9):12.2f}"
                        for r in RATES_GBIT)
        # codes pay where codec + codes' wire < bf16's wire: rate < (bf16 - codes) bytes * 8 / codec time
        pay = (bf16_bytes - codes_bytes) * 8 / codec / 1e9
        print(f"{name:>8} {1e3 * codec:14.2f}{cells} {pay:13.1f} Gb/s", flush=True)


if __name__ == "__main__":
    main()
