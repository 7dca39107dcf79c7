"""The exchange's host cost against the number of tensors: the same elements in 1 to 1000 tensors,
on every entry point.

    python examples/benchmark_tensor_count.py [--elements 4194304] [--counts 1,10,100,300,1000]
                                              [--entry-points driver,horovod,codes,ddp,fsdp,tensorflow]

driver: the exchange driver alone (hvd_aps.exchange.run), as rank 0 of 2 ranks that hold the same
gradients (hvd_aps.calibration.Mirror): nothing waits for a wire, so its time is the exchange's own
host work, stats on as users run it. The entry points run 2 ranks on loopback (horovodrun --gloo,
torchrun with Gloo) on a model of T vectors (synthetic_models' `tensors` profile: each gradient a
fixed vector, so the step is mostly the exchange), timed after the run-time schedule settled, beside
the framework's own float32 allreduce of the same model (in the same job, timed steps alternated,
where the benchmark script takes several compressions: Horovod's torch benchmark; else in jobs back
to back): horovod is the one-line compressor in horovod.torch.DistributedOptimizer, codes
hvd_aps.torch.DistributedOptimizer, ddp the DDP hook, fsdp FSDP2's reduce-scatter (one flat buffer a
module whatever its tensors), tensorflow the one-line compressor in Horovod's TF tape. For each,
the median step in ms at every tensor count and the cost per tensor: the step's growth from the
fewest tensors to the most, divided by the tensors added, for codes, for float32, and the
difference (what the compression itself adds per tensor), and the same difference for the
framework's 16-bit peer (Horovod's Compression.fp16, DDP's fp16_compress_hook), and for horovod
the floor (recipes.Tokens: Horovod's per-gradient path alone, a token a gradient and no exchange,
what any compressor that keeps Horovod's optimizer pays per tensor); then the same differences
in CPU time a step (every thread of a rank's process: the host's cost, which the
machine's other load moves far less than it moves the wall clock on a shared machine). Stats on, as
users run it.
"""
import argparse
import contextlib
import json
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np
import psutil

import recipes

HERE = pathlib.Path(__file__).parent
BIN = pathlib.Path(sys.executable).parent
RANKS = 2
LAUNCH_TIMEOUT_S = 900
# entry point -> (launcher, script, the compressions it times: the framework's own, its 16-bit
# peer, for Horovod's optimizer its per-gradient path alone (recipes.FLOOR), then codes)
ENTRY_POINTS = {
    "horovod": ("horovodrun", "pytorch_synthetic_benchmark.py", ["none,fp16,tokens,aps-e4m3"]),
    "codes": ("horovodrun", "pytorch_synthetic_benchmark.py", ["none,fp16,codes-e4m3"]),
    "ddp": ("torchrun", "pytorch_ddp_synthetic_benchmark.py", ["none", "fp16", "aps-e4m3"]),
    "fsdp": ("torchrun", "pytorch_fsdp_synthetic_benchmark.py", ["none", "fp16", "aps-e4m3"]),
    "tensorflow": ("horovodrun", "tensorflow2_synthetic_benchmark.py", ["none", "fp16", "aps-e4m3"]),
}


def driver_ms(elements: int, tensors: int, repeats: int = 9) -> float:
    """Median ms of one exchange of `elements` in `tensors` equal tensors, rank 0 of RANKS mirrored."""
    import hvd_aps
    from hvd_aps import calibration, exchange
    from hvd_aps._stages import Bucket
    comp = hvd_aps.APSCompressor("e4m3", chunk_bytes=0)
    stages = comp.exchanger.stages(RANKS, 0)
    sizes = [elements // tensors] * tensors
    flat = (np.random.default_rng(0).standard_normal(sum(sizes)) * 1e-3).astype(np.float32)
    out = np.empty_like(flat)
    keys = [f"t{i}" for i in range(tensors)]
    bucket = Bucket.whole(f"count{tensors}", keys, keys, sizes)
    levels = exchange.Levels.flat(calibration.Mirror(RANKS))
    times = []
    for _ in range(repeats + 2):  # the first two make the tables and buffers
        start = time.perf_counter()
        exchange.run(stages, bucket, flat, levels, out=out, average=True)
        comp.state.commit()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def launch(entry: str, compression: str, tensors: int, elements: int, args) -> dict:
    """compression name -> (median step ms, CPU ms a step of a rank's process) of one job of
    `entry` on `tensors` vectors."""
    launcher, script, _ = ENTRY_POINTS[entry]
    prefix = ([str(BIN / "horovodrun"), "-np", str(RANKS), "-H", f"localhost:{RANKS}", "--gloo", sys.executable]
              if launcher == "horovodrun" else [str(BIN / "torchrun"), "--nproc-per-node", str(RANKS)])
    command = prefix + [str(HERE / script), "--profile", "tensors", "--tensors", str(tensors),
                        "--tensor-elements", str(elements // tensors), "--batch-size", "1", "--compression",
                        compression, "--num-warmup-batches", str(args.warmup), "--num-iters", str(args.iters),
                        "--stats"]  # as users run it
    run = bounded(command)
    # horovodrun prefixes each rank's lines with "[rank]<stdout>:"
    rows = [json.loads(line[line.index("{"):]) for line in run.stdout.splitlines()
            if line.startswith("{") or "<stdout>:{" in line]
    if run.returncode != 0 and rows:  # Gloo's teardown can abort a rank after the timed steps printed
        print(f"[{entry}] {compression}: exit {run.returncode} after its rows were printed", file=sys.stderr)
    if not rows:
        raise RuntimeError(f"{' '.join(command)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return {row["compression"]: (1e3 * row["step_median"], 1e3 * row["cpu_per_step"]) for row in rows}


def bounded(command) -> subprocess.CompletedProcess:
    """`command` run to its end; past LAUNCH_TIMEOUT_S it is killed with every process under it
    (the launchers start their ranks in sessions of their own: killing the launcher's alone would
    leave them running)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE) as proc:
        try:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            raise RuntimeError(f"{' '.join(command)} ran past {LAUNCH_TIMEOUT_S} s: killed with its ranks") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def per_tensor_us(ms: dict) -> float:
    """The step's growth from the fewest tensors to the most, per tensor added, in microseconds."""
    low, high = min(ms), max(ms)
    return 1e3 * (ms[high] - ms[low]) / (high - low) if high > low else float("nan")


def entry_row(entry: str, counts: list, args) -> dict:
    """One entry point's steps at every tensor count: codes, float32 and float16 (and Horovod's
    per-gradient path alone, recipes.Tokens, where the entry point is Horovod's optimizer), each as
    the median step's ms and the CPU ms a step of a rank's process."""
    runs_of = ("codes", "float32", "fp16") + ((recipes.FLOOR,) if entry == "horovod" else ())
    row = {f"{name}_{kind}ms": {} for name in runs_of for kind in ("", "cpu_")}
    for t in counts:
        steps = {}
        for names in ENTRY_POINTS[entry][2]:
            steps.update(launch(entry, names, t, args.elements, args))
        runs = {"float32": steps.pop("none"), "fp16": steps.pop("fp16"),
                **({recipes.FLOOR: steps.pop(recipes.FLOOR)} if recipes.FLOOR in steps else {}),
                "codes": next(iter(steps.values()))}
        for name, (ms, cpu_ms) in runs.items():
            row[f"{name}_ms"][t], row[f"{name}_cpu_ms"][t] = ms, cpu_ms
        print(f"[{entry}] {t} tensors: " + ", ".join(f"{name} {ms:.1f} ms ({cpu_ms:.1f} ms CPU)"
                                                     for name, (ms, cpu_ms) in runs.items()), flush=True)
    return {"entry": entry, **row}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22, help="elements in every model (4M: 16 MiB)")
    parser.add_argument("--counts", default="1,10,100,300,1000", help="tensor counts")
    parser.add_argument("--entry-points", default="driver," + ",".join(ENTRY_POINTS))
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before the schedule settles")
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument("--json", help="write the table's rows here")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    for entry in args.entry_points.split(","):
        if entry == "driver":
            ms = {t: driver_ms(args.elements, t) for t in counts}
            rows.append({"entry": "driver", "codes_ms": ms})
        else:
            rows.append(entry_row(entry, counts, args))
        row = rows[-1]
        row["codes_us_per_tensor"] = per_tensor_us(row["codes_ms"])
        if "float32_ms" in row:
            for kind in ("", "cpu_"):  # the step's wall clock, then its CPU
                native = per_tensor_us(row[f"float32_{kind}ms"])
                row[f"float32_{kind}us_per_tensor"] = native
                row[f"extra_{kind}us_per_tensor"] = per_tensor_us(row[f"codes_{kind}ms"]) - native
                row[f"fp16_extra_{kind}us_per_tensor"] = per_tensor_us(row[f"fp16_{kind}ms"]) - native
                if f"{recipes.FLOOR}_ms" in row:
                    row[f"floor_extra_{kind}us_per_tensor"] = per_tensor_us(row[f"{recipes.FLOOR}_{kind}ms"]) - native
    header = f"{'entry point':>12} " + " ".join(f"{f'{t} tensors':>12}" for t in counts) + \
        f" {'us/tensor':>10} {'fp32 us/tensor':>15} {'codes - fp32':>13} {'fp16 - fp32':>12}" + \
        f" {'CPU: codes - fp32':>18} {'fp16 - fp32':>12} {'floor - fp32':>13} {'CPU: floor - fp32':>18}"
    print(f"{args.elements} float32 elements in 1..{max(counts)} tensors, {RANKS} ranks; codes step ms "
          f"(float32's in brackets)\n{header}")
    for row in rows:
        cells = " ".join(f"{row['codes_ms'][t]:5.1f}" + (f" ({row['float32_ms'][t]:4.1f})" if "float32_ms" in row
                                                          else " " * 7) for t in counts)
        native = (f"{row['float32_us_per_tensor']:15.1f} {row['extra_us_per_tensor']:13.1f} "
                  f"{row['fp16_extra_us_per_tensor']:12.1f} {row['extra_cpu_us_per_tensor']:18.1f} "
                  f"{row['fp16_extra_cpu_us_per_tensor']:12.1f}" if "float32_ms" in row else "")
        floor = (f" {row['floor_extra_us_per_tensor']:13.1f} {row['floor_extra_cpu_us_per_tensor']:18.1f}"
                 if "floor_extra_us_per_tensor" in row else "")
        print(f"{row['entry']:>12} {cells} {row['codes_us_per_tensor']:10.1f} {native}{floor}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
