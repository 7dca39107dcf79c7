"""Codec throughput against peers measured in the same run.

    python examples/benchmark_codec.py [--mib 64] [--repeats 7]          # CPU
    python examples/benchmark_codec.py --device cuda [--repeats 20]      # GPU, 1 MiB .. 1 GiB

CPU: GB/s of float32 converted (a round trip is encode + decode), against ml_dtypes' astype and
torch's float8 casts; then the codes exchange's reduce step, decode-and-sum of N=4 ranks'
packed code buffers, two ways in the same run: unpacking each rank's buffer and adding one rank
at a time (unpack + codec.decode_sum, the way the exchange summed before), and in one pass
straight from the packed bytes (codec.decode_sum_rows, what it does now), with their ratio; then
the other fused stages against what they replaced, interleaved likewise: 4-bit encode then pack
against encode_into (codes written straight into the packed stream), and the final decode
through the caches against past them (decode_row's stream, non-temporal stores). GPU: GB/s of
bytes read + written by encode, decode and decode-accumulate
(4 ranks' code buffers into one float32 sum), against a device-to-device copy (its bytes read +
written) and torch's `.to(torch.float8_e4m3fn)`. Figures are medians of --repeats timed runs
after a warm-up run.
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


def gpu_seconds(fn, repeats):
    """Median time of fn on the GPU, from CUDA events around each call."""
    import cupy
    fn()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def gpu_main(repeats):
    import cupy
    import torch
    print(f"GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, e4m3, median of {repeats}; "
          "GB/s of bytes read + written")
    header = ["size", "copy", "encode", "x copy", "decode", "x copy", "decode-acc(4)", "x copy", "torch cast", "enc/torch"]
    print("  ".join(f"{h:>13}" for h in header))
    for mib in (1, 4, 16, 64, 256, 1024):
        n = mib << 18
        x = cupy.random.standard_normal(n, dtype=cupy.float32)
        codes = hvd_aps.encode(x, "e4m3")
        stacked = cupy.stack([codes] * 4)
        out = cupy.empty_like(x)
        tx = torch.from_dlpack(x)
        copy = 8 * n / gpu_seconds(lambda: cupy.copyto(out, x), repeats) / 1e9
        enc = 5 * n / gpu_seconds(lambda: hvd_aps.encode(x, "e4m3"), repeats) / 1e9
        dec = 5 * n / gpu_seconds(lambda: hvd_aps.decode(codes, "e4m3"), repeats) / 1e9
        acc = 12 * n / gpu_seconds(lambda: hvd_aps.decode_sum(stacked, "e4m3", out=out), repeats) / 1e9
        cast = 5 * n / gpu_seconds(lambda: tx.to(torch.float8_e4m3fn), repeats) / 1e9
        row = [f"{mib} MiB", f"{copy:.0f}", f"{enc:.0f}", f"{enc / copy:.2f}", f"{dec:.0f}", f"{dec / copy:.2f}",
               f"{acc:.0f}", f"{acc / copy:.2f}", f"{cast:.0f}", f"{enc / cast:.2f}x"]
        print("  ".join(f"{c:>13}" for c in row), flush=True)
    gpu_stages(repeats)


def gpu_stages(repeats):
    """The exchange's packed-row stages on the device at 64 MiB and 1 GiB of float32: encode
    straight into a packed stream (8- and 4-bit), decode-and-sum of N = 2, 4, 8 packed rows,
    decode of a row; GB/s of bytes read + written, and as a fraction of the copy."""
    import cupy
    print("\npacked-row stages (GB/s of bytes read + written, x copy)")
    print("  ".join(f"{h:>16}" for h in ("size", "stage", "GB/s", "x copy")))
    for mib in (64, 1024):
        n = mib << 18
        x = cupy.random.standard_normal(n, dtype=cupy.float32)
        out = cupy.empty_like(x)
        copy = 8 * n / gpu_seconds(lambda: cupy.copyto(out, x), repeats) / 1e9
        for name in ("e4m3", "e2m1fn"):
            fmt = hvd_aps.FloatFormat.parse(name)
            size = codec.packed_size(n, fmt)
            row = cupy.zeros(size, cupy.uint8)
            rates = {f"encode_into {name}": (4 * n + size) / gpu_seconds(
                lambda: codec.encode_into(x, fmt, row, 0, shift=2), repeats)}
            for ranks in (2, 4, 8):
                rows = cupy.stack([row] * ranks)
                rates[f"sum {ranks} rows {name}"] = (ranks * size + 4 * n) / gpu_seconds(
                    lambda: codec.decode_sum_rows(rows, fmt, 0, n, 2, out=out), repeats)
            rates[f"decode_row {name}"] = (size + 4 * n) / gpu_seconds(
                lambda: codec.decode_row(row, fmt, 0, n, 2, out=out, divisor=4), repeats)
            for stage, rate in rates.items():
                print("  ".join(f"{c:>16}" for c in (f"{mib} MiB", stage, f"{rate / 1e9:.0f}", f"{rate / 1e9 / copy:.2f}")),
                      flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mib", type=int, default=64, help="CPU: float32 tensor size in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.device == "cuda":
        return gpu_main(args.repeats)
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
    print(f"\ndecode-and-sum of {RANKS} ranks' packed codes, {args.mib} MiB of float32 sums each")
    print("  ".join(f"{h:>16}" for h in ["format", "per rank GB/s", "one pass GB/s", "x per rank"]))
    for fmt in FORMATS:
        per_rank, one_pass = decode_sum_seconds(x, fmt, args.repeats)
        print("  ".join(f"{c:>16}" for c in [fmt, f"{gbs(per_rank):.2f}", f"{gbs(one_pass):.2f}",
                                              f"{per_rank / one_pass:.2f}x"]))
    print(f"\nfused stages, {args.mib} MiB of float32 in (encode) or out (decode)")
    print("  ".join(f"{h:>24}" for h in ["stage", "before GB/s", "fused GB/s", "x before"]))
    for label, (before, fused) in fused_stage_seconds(x, args.repeats).items():
        cells = [label, f"{gbs(before):.2f}", f"{gbs(fused):.2f}", f"{before / fused:.2f}x"]
        print("  ".join(f"{c:>24}" for c in cells))


RANKS = 4


def decode_sum_seconds(x, fmt, repeats):
    """Median seconds of the reduce step's sum of RANKS packed buffers, unpack-and-add-per-rank
    against one pass; the two results checked equal bit for bit first."""
    fmt = hvd_aps.FloatFormat.parse(fmt)
    rows = np.stack([codec.pack(hvd_aps.encode(np.roll(x, r), fmt, shift=2), fmt) for r in range(RANKS)])
    added, summed = np.empty(x.size, np.float32), np.empty(x.size, np.float32)

    def per_rank():
        added.fill(0)
        return codec.decode_sum(np.stack([codec.unpack(row, fmt, x.size) for row in rows]), fmt, 2, out=added)

    def one_pass():
        return codec.decode_sum_rows(rows, fmt, 0, x.size, 2, out=summed)[0]

    assert per_rank().tobytes() == one_pass().tobytes()
    return paired_seconds(per_rank, one_pass, repeats)


def fused_stage_seconds(x, repeats):
    """{stage: (seconds before, seconds fused)}, each pair checked equal byte for byte first."""
    out = {}
    for fmt in ("e3m0", "e2m1fn"):
        codes, row = np.empty(x.size, np.uint8), np.empty(codec.packed_size(x.size, fmt), np.uint8)
        before = lambda: codec.pack(hvd_aps.encode(x, fmt, shift=2, out=codes), fmt)
        fused = lambda: codec.encode_into(x, fmt, row, 0, shift=2)
        assert before().tobytes() == fused().tobytes()
        out[f"{fmt} encode + pack"] = paired_seconds(before, fused, repeats)
    for fmt in ("e4m3", "e3m0"):
        row, values = codec.pack(hvd_aps.encode(x, fmt, shift=2), fmt), np.empty(x.size, np.float32)

        def decode(stream):
            return codec.decode_row(row, fmt, 0, x.size, 2, out=values, divisor=4, stream=stream)

        assert decode(False).copy().tobytes() == decode(True).tobytes()
        out[f"{fmt} decode past caches"] = paired_seconds(lambda: decode(False), lambda: decode(True), repeats)
    return out


def paired_seconds(before, after, repeats):
    """Medians of two ways to do one thing, timed alternately so both see the same machine."""
    pairs = [(median_seconds(before, 1), median_seconds(after, 1)) for _ in range(repeats)]
    return statistics.median(b for b, _ in pairs), statistics.median(a for _, a in pairs)


if __name__ == "__main__":
    main()
