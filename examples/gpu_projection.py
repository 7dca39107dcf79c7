"""The GPU codes exchange projected from its kernels' own work, not measured.

What one steady-state exchange of a bucket does on a GPU is counted on the CPU: the exchange runs
as rank 0 of 8 (calibrate's mirrored ranks, unchunked, as `calibrate --device cuda` times it) on
the counting CuPy stand-in, whose kernels are ops/kernels.cu's own text built to count every
32-byte sector of device memory they read or write (tests/simt.py, tests/simt/count.cc). Per
bucket that gives the kernel launches, CuPy's own operations, the reads back to the host, the
uploads and each kernel's bytes. At the rates below each becomes time:

    host    (launches + operations + uploads) x HOST_CALL_S + reads x READ_S
    device  per kernel max(DEVICE_LAUNCH_S, its bytes / its RATE), per operation DEVICE_LAUNCH_S

and their sum, over the buckets calibrate times, is fitted as calibrate fits its measurements (a
cost per exchange, per tensor, per element). The file it writes is a calibration file whose "kind"
is "projected": `python -m hvd_aps plan --device cuda` uses it, and says so, until
`scripts/gpu_check.sh` measures a device and its calibration file takes its place.

    .venv/bin/python examples/gpu_projection.py [--out hvd_aps/gpu_projection.json]
    python examples/gpu_projection.py --against calibration_gpu.json   # a device's measurement beside it

The rates are an H200's: the table kernels have not run on a device, but the kernels before them,
which ran the same per-element code of ops/fpcodec.h, were measured on one.
"""
import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

from hvd_aps import APSCompressor, calibration, exchange
from hvd_aps._stages import Bucket

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"  # the counting stand-in and the SIMT layer


DEVICE = "NVIDIA H200"
# Bytes read + written a second, measured on one NVIDIA H200 on 2026-11-26 (docs/gpu.md,
# examples/benchmark_codec.py at 64 MiB, e4m3) with the packed-row stages that preceded the table
# kernels and ran the same per-element code: encode 249 GB/s, the sum of 8 ranks' rows 284 GB/s,
# decode 356 GB/s; the kernels without per-element codec work (max |x|, the stats' sample, the
# shifts) at the rate of a device-to-device copy of the same size, 2,727 GB/s.
RATES = {"hvd_table_encode": 249e9, "hvd_table_sum": 284e9, "hvd_table_decode": 356e9}
COPY_RATE = 2727e9
HOST_CALL_S = 15e-6  # a launch, CuPy operation or upload from Python: an H200 ResNet-50 step spent about 100 ms of
#                      host time on 6,867 CUDA calls (torch.profiler, docs/gpu.md, 2026-11-26)
READ_S = 30e-6  # a read back to the host: a synchronisation and a small copy, two calls' worth (assumed)
DEVICE_LAUNCH_S = 3e-6  # the least time a kernel holds the device (a launch's latency; assumed)
WORLD = 8
BUCKETS = ((1 << 14, 1), (1 << 18, 1), (1 << 22, 1), (1 << 14, 16), (1 << 18, 16), (1 << 22, 16), (1 << 18, 256))
FORMATS = ("e4m3", "e3m0")
WARM = 2  # untimed exchanges before the counted one


@dataclasses.dataclass(frozen=True)
class Counted:
    """One steady-state exchange of a bucket, as rank 0 ran it on the stand-in."""
    elements: int
    tensors: int
    launches: int
    operations: int
    reads: int
    uploads: int
    kernel_bytes: tuple  # per kernel launch, (its name, bytes of device memory it read and wrote)

    @property
    def seconds(self) -> float:
        """Host driver plus device time of the exchange at the stated rates."""
        host = (self.launches + self.operations + self.uploads) * HOST_CALL_S + self.reads * READ_S
        kernels = sum(max(DEVICE_LAUNCH_S, b / RATES.get(name, COPY_RATE)) for name, b in self.kernel_bytes)
        return host + kernels + self.operations * DEVICE_LAUNCH_S


def _package_work(events: list) -> list:
    """Events of the exchange itself: those of calibration.Mirror (standing for the collectives) out."""
    return [e for e in events if not e.stack[0].startswith("hvd_aps/calibration.py")]


def count(fmt: str, elements: int, tensors: int) -> Counted:
    """One bucket's steady-state exchange on the stand-in, rank 0 of WORLD, counted."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import counting_cupy as standin
    import simt
    comp = APSCompressor(fmt, chunk_bytes=0)
    stages = comp.exchanger.stages(WORLD, 0)
    keys = [f"t{i}" for i in range(tensors)]
    bucket = Bucket.whole("projection", keys, keys, [elements // tensors] * tensors)
    levels = exchange.Levels.flat(calibration.Mirror(WORLD))
    rng = np.random.default_rng(0)
    with standin.installed() as counts:
        flat = standin.cupy.asarray(rng.standard_normal(elements // tensors * tensors).astype(np.float32) * np.float32(1e-3))
        out = standin.cupy.empty(flat.size, np.float32)
        for _ in range(WARM):
            exchange.run(stages, bucket, flat, levels, out=out, average=True)
            comp.state.commit()
        counts.reset()
        with simt.Traffic() as traffic:  # reads: the bucket's metadata, and the step before's stats
            exchange.run(stages, bucket, flat, levels, out=out, average=True)
            comp.state.commit()
        events = {kind: _package_work(counts.of(kind)) for kind in ("launch", "op", "read", "upload")}
    return Counted(elements // tensors * tensors, tensors, len(events["launch"]), len(events["op"]), len(events["read"]),
                   len(events["upload"]), tuple((m.name, m.bytes) for m in traffic.launches))


def project(formats=FORMATS, buckets=BUCKETS) -> dict:
    """The calibration file's contents, projected."""
    codecs, counted = {}, {}
    for fmt in formats:
        rows = []
        for n, t in buckets:
            c = count(fmt, n, t)
            rows.append((c.elements, t, c.seconds))
            moved = sum(b for _, b in c.kernel_bytes)
            counted.setdefault(fmt, []).append(dict(dataclasses.asdict(c), kernel_bytes=moved,
                                                    projected_seconds=c.seconds))
            print(f"{fmt} {n:>9} elements {t:>4} tensors: {c.launches} kernels ({moved / c.elements:.1f} bytes an "
                  f"element), {c.operations} CuPy operations, {c.reads} reads, {c.uploads} uploads: "
                  f"{1e3 * c.seconds:.3f} ms projected", flush=True)
        codecs[fmt] = dataclasses.asdict(calibration.fit_rows(rows, device=True))
    return {"format": calibration.FORMAT, "kind": "projected", "engine": "cupy", "device": DEVICE,
            "date": time.strftime("%Y-%m-%d"), "world": WORLD, "command": "python examples/gpu_projection.py",
            "rates": {"bytes_per_s": RATES, "copy_bytes_per_s": COPY_RATE, "host_call_s": HOST_CALL_S,
                      "read_s": READ_S, "device_launch_s": DEVICE_LAUNCH_S,
                      "source": "docs/gpu.md: one NVIDIA H200, 2026-11-26, the kernels before the table kernels"},
            "codecs": codecs, "counted": counted}


def against(path) -> None:
    """A device's measured exchanges (`calibrate --device cuda`) beside the projection's for the same
    buckets."""
    measured, projected = json.loads(pathlib.Path(path).read_text()), calibration.load(calibration.GPU_PROJECTION)
    print(f"measured on {measured.get('device')} ({measured.get('date')}) against {projected.describe()}")
    print(f"{'format':>6} {'elements':>9} {'tensors':>7} {'measured ms':>11} {'projected ms':>12} {'x projected':>11}")
    for fmt, rows in measured.get("measured", {}).items():
        codec = projected.codecs.get(fmt)
        for row in rows if codec else []:
            guess = codec.time(row["elements"], row["tensors"])
            print(f"{fmt:>6} {row['elements']:>9} {row['tensors']:>7} {1e3 * row['seconds']:>11.3f} {1e3 * guess:>12.3f} "
                  f"{row['seconds'] / guess:>11.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(calibration.GPU_PROJECTION))
    parser.add_argument("--against", help="a calibration file measured on a device: print it beside the projection")
    args = parser.parse_args()
    if args.against:
        return against(args.against)
    result = project()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for fmt, c in result["codecs"].items():
        print(f"{fmt}: {1e3 * c['fixed']:.3f} ms an exchange, {1e6 * c['per_tensor']:.2f} us a tensor, "
              f"{1e12 * c['per_element']:.2f} ps an element (projected, not measured) -> {args.out}")


if __name__ == "__main__":
    main()
