"""The performance model's predictions at scale, on paper: 8 to 1024 GPUs (8 a host, NVLink
inside), 25 Gbit/s to 3.2 Tbit/s between hosts, ResNet-50 and 1B- and 7B-parameter transformers,
hvd_aps's codes against float32, bf16 and NCCL's own FP8 allreduce; and the shape of Dettmers'
96-GPU claim (arXiv 1511.04561: 8-bit 50x against 32-bit 23x).

    python examples/perf_at_scale.py [--json docs/perf_at_scale.json]

Nothing here was measured on such a cluster: every number below is an assumption, stated where it
is set, and the model is hvd_aps.perf (docs/performance-model.md), checked only on the 2-core
netns cluster. The GPU codec is projected, not measured (examples/gpu_projection.py).
"""
import argparse
import dataclasses
import json
import math

from hvd_aps import calibration, perf

GPUS_PER_HOST = 8
GPU_COUNTS = (8, 64, 256, 1024)
HOST_LINKS = ("25gbit", "100gbit", "400gbit", "3200gbit")  # a host's links between hosts, all NICs together
# RDMA between hosts (InfiniBand or RoCE): a few microseconds a message step
BETWEEN_LATENCY = 5e-6
# inside a host: nccl-tests' allreduce bus bandwidth on an 8-GPU H100 host is about 360 GB/s,
# some 80 % of NVLink 4's 450 GB/s a direction
NVLINK = perf.Link(360e9, 3e-6)
# The GPU codec projected, not measured (examples/gpu_projection.py: the kernels' launches, reads
# and bytes counted on the CPU, at an H200's measured rates): a cost per exchange (the host's
# driver: launches, reads, Python), per tensor and per element (the kernels' passes, Codec.busy);
# the world it was counted at (8) stands for every world here. A calibration file measured on a
# device (scripts/gpu_check.sh) takes its place with --calibration.
GPU = calibration.load(calibration.GPU_PROJECTION)
# A step's compute on one H100 (bf16, mixed precision), forward + backward, two thirds backward:
# ResNet-50 at 256 images a GPU and about 2,850 images/s (MLPerf-class); transformers at
# 6 x parameters x tokens FLOPs and 400 TFLOP/s (40 % of the H100's dense bf16 peak).
TRANSFORMER_FLOPS = 400e12
WORKLOADS = {
    "ResNet-50": perf.Workload(25_557_032, 256 / 2850),
    "transformer 1B": perf.Workload(1_000_000_000, 6 * 1e9 * 16_384 / TRANSFORMER_FLOPS),
    "transformer 7B": perf.Workload(7_000_000_000, 6 * 7e9 * 8_192 / TRANSFORMER_FLOPS),
}


def paths(codecs: dict) -> tuple:
    return (perf.Path("float32", 32), perf.Path("bf16", 16), perf.Path("NCCL fp8", 8),
            perf.Path("e4m3", 8, codecs["e4m3"]), perf.Path("e3m0", 4, codecs["e3m0"]))


PATHS = paths(GPU.codecs)
DETTMERS_GPUS, DETTMERS_FP32_SPEEDUP = 96, 23
BUCKET_CAPS_MB = (25, 100, 400)  # DDP's bucket_cap_mb: 25 by default


def cluster(gpus: int, link: str) -> perf.Cluster:
    hosts = max(1, gpus // GPUS_PER_HOST)
    return perf.Cluster(hosts, perf.Link.parse(link, BETWEEN_LATENCY), min(gpus, GPUS_PER_HOST), NVLINK, tree=True)


def rows(paths=PATHS) -> list:
    """One row per (model, GPUs, link): the predicted step of every path, x bf16's."""
    out = []
    for model, w in WORKLOADS.items():
        for gpus in GPU_COUNTS:
            for link in HOST_LINKS[:1] if gpus == GPUS_PER_HOST else HOST_LINKS:
                c = cluster(gpus, link)
                steps = {p.name: perf.step_time(w, p, c) for p in paths}
                out.append({"model": model, "gpus": gpus, "link": "NVLink only" if gpus == GPUS_PER_HOST else link,
                            "compute_ms": 1e3 * w.compute, "step_ms": {k: 1e3 * v for k, v in steps.items()},
                            "best": min(steps, key=steps.get)})
    return out


def markdown(table: list) -> str:
    names = list(table[0]["step_ms"])
    lines = ["| model | GPUs | between hosts | compute ms | bf16 step ms | " + " | ".join(f"{n} x bf16" for n in names if n != "bf16")
             + " | fastest |", "|" + "---|" * (len(names) + 5)]
    for r in table:
        bf16 = r["step_ms"]["bf16"]
        ratios = " | ".join(f"{r['step_ms'][n] / bf16:.2f}" for n in names if n != "bf16")
        lines.append(f"| {r['model']} | {r['gpus']} | {r['link']} | {r['compute_ms']:.0f} | {bf16:.0f} | {ratios} | {r['best']} |")
    return "\n".join(lines)


def dettmers() -> dict:
    """96 GPUs, ResNet-50's compute: the host link at which float32 scales 23x (bisection on a log
    scale), and what 8 bits would give there: NCCL's fp8 (no codec) and e4m3 codes."""
    w, fp32 = WORKLOADS["ResNet-50"], PATHS[0]
    def speedup(path, bandwidth):
        c = dataclasses.replace(cluster(DETTMERS_GPUS, "1gbit"), between=perf.Link(bandwidth, BETWEEN_LATENCY))
        return DETTMERS_GPUS * w.compute / perf.step_time(w, path, c)
    low, high = 1e6, 1e12
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if speedup(fp32, mid) < DETTMERS_FP32_SPEEDUP else (low, mid)
    return {"gbit": high * 8 / 1e9, **{p.name: speedup(p, high) for p in PATHS}}


def bucket_caps(model: str = "transformer 7B", gpus: int = 1024) -> dict:
    """x bf16 of e4m3 and e3m0 at each DDP bucket cap: the codes exchange pays 2(H - 1) message
    steps a bucket (alltoall, allgather) where NCCL's tree pays 2 log2 N, so at many hosts fewer,
    larger buckets matter."""
    w = WORKLOADS[model]
    out = {}
    for link in HOST_LINKS:
        c = cluster(gpus, link)
        for cap in BUCKET_CAPS_MB:
            sized = dataclasses.replace(w, buckets=perf.ddp_buckets(w.parameters, bytes_=cap << 20))
            bf16 = perf.step_time(sized, PATHS[1], c)
            out[f"{link} {cap} MB"] = {p.name: perf.step_time(sized, p, c) / bf16 for p in PATHS[3:]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    table = rows()
    print(f"The GPU codec: {GPU.describe()}\n")
    print(markdown(table))
    shape = dettmers()
    print(f"\n{DETTMERS_GPUS} GPUs, ResNet-50: float32 scales {shape['float32']:.0f}x at {shape['gbit']:.1f} Gbit/s a host; "
          + ", ".join(f"{name} {shape[name]:.0f}x" for name in ("bf16", "NCCL fp8", "e4m3", "e3m0")))
    caps = bucket_caps()
    print("\ntransformer 7B, 1024 GPUs, x bf16 by DDP's bucket_cap_mb: "
          + "; ".join(f"{key}: " + ", ".join(f"{name} {x:.2f}" for name, x in v.items()) for key, v in caps.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"codec": {"kind": GPU.kind.value, "device": GPU.device, "date": GPU.date, "command": GPU.command},
                       "rows": table, "dettmers": shape, "bucket_caps": caps}, f, indent=1)


if __name__ == "__main__":
    main()
