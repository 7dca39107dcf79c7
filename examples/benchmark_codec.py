"""Codec throughput on the CPU against ml_dtypes' and torch's float8 casts, measured in one run.

    python examples/benchmark_codec.py [--mib 64] [--repeats 7]

GB/s counts the float32 bytes converted (one round trip = encode + decode of the tensor).
Each figure is the median of --repeats timed runs after one warm-up run.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import hvd_aps
from hvd_aps import codec

FORMATS = ["e4m3", "e4m3fn", "e5m2", "e3m0"]
TORCH_TWINS = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_round_trip(x, fmt):
    try:
        import torch
    except ImportError:
        return None
    if fmt not in TORCH_TWINS:
        return None
    t, dtype = torch.from_numpy(x), getattr(torch, TORCH_TWINS[fmt])
    return lambda: t.to(dtype).float()


def ml_dtypes_round_trip(x, fmt):
    name = hvd_aps.FloatFormat.parse(fmt).ml_dtypes_name
    if name is None:
        return None
    dtype = getattr(ml_dtypes, name)
    return lambda: x.astype(dtype).astype(np.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="float32 tensor size in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(args.mib * (1 << 18)).astype(np.float32)
    gbs = lambda seconds: x.nbytes / seconds / 1e9
    print(f"{args.mib} MiB float32, median of {args.repeats}, engine={codec.engine_name()}")
    print(f"memcpy (np.copy): {gbs(median_seconds(x.copy, args.repeats)):.2f} GB/s\n")
    header = ["format", "encode", "decode", "round trip", "ml_dtypes rt", "x ml_dtypes", "torch rt", "x torch"]
    print("  ".join(f"{h:>12}" for h in header))
    for fmt in FORMATS:
        codes = hvd_aps.encode(x, fmt)
        ours = gbs(median_seconds(lambda: hvd_aps.quantize(x, fmt), args.repeats))
        row = [fmt, f"{gbs(median_seconds(lambda: hvd_aps.encode(x, fmt), args.repeats)):.2f}",
               f"{gbs(median_seconds(lambda: hvd_aps.decode(codes, fmt), args.repeats)):.2f}", f"{ours:.2f}"]
        for peer in (ml_dtypes_round_trip(x, fmt), torch_round_trip(x, fmt)):
            theirs = gbs(median_seconds(peer, args.repeats)) if peer else None
            row += [f"{theirs:.2f}", f"{ours / theirs:.2f}x"] if theirs else ["-", "-"]
        print("  ".join(f"{c:>12}" for c in row))


if __name__ == "__main__":
    main()
