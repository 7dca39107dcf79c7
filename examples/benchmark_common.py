"""What the synthetic benchmarks share: timing, the interface's tx counter, the codec speed that
examples/netns_cluster.py's performance model uses, and rank 0's JSON line."""
import json
import statistics
import time

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


PROFILES = ("mlp", "large", "resnet50")  # see synthetic_models.py


def measure(step, args, phases, params, allgather_object, rank, size):
    """Warm up, time args.num_iters steps, read the tx counter; rank 0 prints one JSON line.
    phases: compute-only seconds of the step's forward, backward and optimizer (or of the
    whole step, {"step": s}, where they cannot be told apart)."""
    timed(step, args.num_warmup_batches)
    before = tx_bytes(args.iface)
    times = timed(step, args.num_iters)
    sent = (tx_bytes(args.iface) - before) / args.num_iters
    per_rank = allgather_object({"step": statistics.median(times), "tx_bytes_per_step": sent,
                                 "phases": phases, "codec_gbps": codec_gbps(params)})
    if rank == 0:
        print(json.dumps({"compression": args.compression, "profile": args.profile, "ranks": size, "params": params,
                          "step_median": max(r["step"] for r in per_rank),
                          "tx_bytes_per_step": statistics.mean(r["tx_bytes_per_step"] for r in per_rank),
                          "compute": statistics.median(sum(r["phases"].values()) for r in per_rank),
                          **{k: statistics.median(r["phases"][k] for r in per_rank) for k in phases},
                          "codec_gbps": statistics.median(r["codec_gbps"] for r in per_rank)}), flush=True)


def compressor_options(args):
    """APSCompressor keywords from the command line: stats off (they cost a pass), chunk_bytes."""
    return {"stats": False, **({} if args.chunk_bytes is None else {"chunk_bytes": args.chunk_bytes})}


def add_arguments(parser):
    parser.add_argument("--compression", default="none")
    parser.add_argument("--profile", choices=PROFILES, default="mlp",
                        help="tensor profile: mlp (4 x hidden^2), large (two 8M layers), resnet50 (161 tensors)")
    parser.add_argument("--hidden", type=int, default=2048, help="mlp: 4 x hidden^2 parameters (2048: 16.8M)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chunk-bytes", type=int, help="APSCompressor's chunk_bytes (0: no pipelining; default its own)")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=8)
    parser.add_argument("--iface", default="", help="network interface whose tx counter to read")
