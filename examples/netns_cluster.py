"""A bandwidth-limited Horovod "cluster" on one machine: one network namespace per host, veth links
into a bridge in a switch namespace, each link capped with `tc tbf`, one rank per host with Gloo.
Runs examples/pytorch_synthetic_benchmark.py for each compression (a "tf:" prefix runs
examples/tensorflow2_synthetic_benchmark.py instead, "ddp:" examples/pytorch_ddp_synthetic_benchmark.py
with torch.distributed ranks whose MASTER_ADDR is host 0) and prints measured step times and bytes
sent beside a performance model. Needs root (ip netns, tc); removes everything it made.

    sudo .venv/bin/python examples/netns_cluster.py [--ranks 2,4] [--rates 1gbit,10gbit,none] [--quick]

All traffic stays inside the namespaces this script creates (10.77.0.0/24).
"""
import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import hvd_aps

EXAMPLES = pathlib.Path(__file__).parent
# aps-*: the card's line (codes through Horovod's own optimizer); aps-*-values: float16 values;
# codes-*: hvd_aps.torch.DistributedOptimizer
COMPRESSIONS = ["none", "fp16", "aps-e4m3-values", "aps-e4m3", "aps-e3m0", "codes-e4m3", "codes-e3m0"]
SWITCH, SUBNET, SERVER_IP = "hvdaps-sw", "10.77.0", "10.77.0.254"
DDP_PORT = 29500
BENCHMARKS = {"": "pytorch_synthetic_benchmark.py", "tf": "tensorflow2_synthetic_benchmark.py",
              "ddp": "pytorch_ddp_synthetic_benchmark.py"}


def sh(*cmd, ns=None, check=True):
    full = (["ip", "netns", "exec", ns] if ns else []) + [str(c) for c in cmd]
    return subprocess.run(full, check=check, capture_output=True, text=True)


@contextlib.contextmanager
def cluster(hosts, rate):
    """Namespaces hvdaps-h0.. with address 10.77.0.(i+1) on iface hvd0, bridged in the switch
    namespace; both directions of every link capped at `rate` (None: uncapped)."""
    names = [f"hvdaps-h{i}" for i in range(hosts)]
    try:
        sh("ip", "netns", "add", SWITCH)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=SWITCH)
        sh("ip", "addr", "add", f"{SERVER_IP}/24", "dev", "br0", ns=SWITCH)
        sh("ip", "link", "set", "br0", "up", ns=SWITCH)
        sh("ip", "link", "set", "lo", "up", ns=SWITCH)
        for i, ns in enumerate(names):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"hvdaps{i}", "type", "veth", "peer", "name", f"hvdaps{i}s")
            sh("ip", "link", "set", f"hvdaps{i}", "netns", ns, "name", "hvd0")
            sh("ip", "link", "set", f"hvdaps{i}s", "netns", SWITCH)
            sh("ip", "link", "set", f"hvdaps{i}s", "master", "br0", "up", ns=SWITCH)
            sh("ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "hvd0", ns=ns)
            sh("ip", "link", "set", "hvd0", "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            if rate:
                for dev, where in (("hvd0", ns), (f"hvdaps{i}s", SWITCH)):
                    sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb",
                       "latency", "100ms", ns=where)
            # Horovod's process-set Gloo contexts resolve the machine's hostname: map it to this host
            etc = pathlib.Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{SUBNET}.{i + 1} {socket.gethostname()}\n")
        yield names
    finally:
        for ns in names + [SWITCH]:
            sh("ip", "netns", "del", ns, check=False)
            with contextlib.suppress(FileNotFoundError):
                (pathlib.Path("/etc/netns") / ns / "hosts").unlink()
                (pathlib.Path("/etc/netns") / ns).rmdir()


def serve_rendezvous(hosts):
    """Run inside the switch namespace: Horovod's own rendezvous server for one rank per host."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(False)
    port = server.start()
    server.init(get_host_assignments(parse_hosts(",".join(f"host{i}:1" for i in range(hosts))), hosts))
    print(port, flush=True)
    sys.stdin.read()  # until the driver closes the pipe


def run_job(names, compression, args):
    server = subprocess.Popen(["ip", "netns", "exec", SWITCH, sys.executable, __file__, "--serve", str(len(names))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        procs = []
        for rank, ns in enumerate(names):
            env = dict(os.environ, HOROVOD_HOSTNAME=f"host{rank}", HOROVOD_RANK=str(rank),
                       HOROVOD_SIZE=str(len(names)), HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                       HOROVOD_CROSS_RANK=str(rank), HOROVOD_CROSS_SIZE=str(len(names)),
                       HOROVOD_GLOO_RENDEZVOUS_ADDR=SERVER_IP, HOROVOD_GLOO_RENDEZVOUS_PORT=port,
                       HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="hvd0",
                       OMP_NUM_THREADS="1", HVD_APS_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
            framework, _, name = compression.rpartition(":")
            script = BENCHMARKS[framework]
            # torch.distributed's Gloo finds its address through the hostname (/etc/netns/<ns>/hosts);
            # GLOO_SOCKET_IFNAME=hvd0 crashed it (SIGSEGV) inside the namespaces
            env.update(MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(DDP_PORT), RANK=str(rank), WORLD_SIZE=str(len(names)),
                       LOCAL_RANK="0")
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(EXAMPLES / script),
                   "--compression", name, "--iface", "hvd0", "--hidden", str(args.hidden), "--profile", args.profile,
                   "--num-iters", str(args.iters)]
            if args.chunk_bytes is not None:
                cmd += ["--chunk-bytes", str(args.chunk_bytes)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=args.timeout) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode:
                raise RuntimeError(f"{compression}: rank {procs.index(p)} failed ({p.returncode}):\n"
                                   f"{outs[procs.index(p)][0][-1000:]}\n{err[-4000:]}")
        return json.loads(outs[0][0].strip().splitlines()[-1])
    finally:
        for p in locals().get("procs", []):
            p.kill()
        server.stdin.close()
        server.wait(timeout=30)


def wire_bytes_per_element(compression):
    """What one gradient element costs on the wire: 4 (fp32), 2 (fp16, float16 values), bits/8 (codes)."""
    kind, _, fmt = compression.rpartition(":")[2].partition("-")
    if kind in ("none", "fp16", "bf16"):
        return 4 if kind == "none" else 2
    if fmt.endswith("-values"):
        return 2
    return hvd_aps.FloatFormat.parse(fmt.split("-")[0]).bits / 8


def model_seconds(result, compression, ranks, link_bytes_per_s):
    """Predicted step with nothing overlapped: compute + ring traffic at the link rate + codec
    passes at measured speed."""
    params, ring = result["params"], 2 * (ranks - 1) / ranks
    codec = 4 * params / (result["codec_gbps"] * 1e9)  # one encode+decode of every gradient
    wire = ring * params * wire_bytes_per_element(compression) / link_bytes_per_s
    kind, _, fmt = compression.rpartition(":")[2].partition("-")
    if kind in ("none", "fp16", "bf16"):
        return result["compute"] + wire
    return result["compute"] + wire + (codec if fmt.endswith("-values") else (1 + 1 / ranks) * codec)


def floor_seconds(result, compression, ranks, link_bytes_per_s):
    """The fastest the step can be: what cannot overlap the exchange (forward, optimizer step)
    plus the larger of backward and the traffic's wire time (uncapped: compute alone). TF rows
    measure the step as a whole and count it all as overlappable."""
    wire = (2 * (ranks - 1) / ranks * result["params"] * wire_bytes_per_element(compression) / link_bytes_per_s
            if link_bytes_per_s else 0.0)
    fixed = result.get("forward", 0.0) + result.get("optimizer", 0.0)
    return fixed + max(result["compute"] - fixed, wire)


def baseline(compression):
    framework = compression.rpartition(":")[0]
    return f"{framework}:none" if framework else "none"


def rate_bytes(rate):
    if rate is None:
        return None
    number, unit = rate[:-4], rate[-4:]
    return float(number) * {"gbit": 1e9, "mbit": 1e6}[unit] / 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rates", default="1gbit,10gbit,none", help="tc tbf rates; none = uncapped")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS))
    parser.add_argument("--profile", default="mlp", help="the benchmarks' tensor profile: mlp, large or resnet50")
    parser.add_argument("--hidden", type=int, default=2048, help="mlp profile: 4 x hidden^2 parameters")
    parser.add_argument("--chunk-bytes", type=int, help="the compressors' chunk_bytes (0: no pipelining)")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per job")
    parser.add_argument("--quick", action="store_true", help="2 ranks at 1gbit, a 1M-parameter model, 3 steps")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_rendezvous(args.serve)
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and tc")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # still remove the namespaces
    if args.quick:
        args.ranks, args.rates, args.hidden, args.iters = "2", "1gbit", 512, 3
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for rate in (None if r == "none" else r for r in args.rates.split(",")):
            with cluster(ranks, rate) as names:
                results = {c: run_job(names, c, args) for c in args.compressions.split(",")}
            measured_link = rate_bytes(rate)
            params = next(iter(results.values()))["params"]
            print(f"\n{ranks} ranks, link {rate or 'uncapped'}, {args.profile} profile, {params} parameters "
                  f"(median of {args.iters} steps; bytes = each rank's tx counter per step)")
            print(f"{'compression':>18} {'step s':>8} {'x none':>7} {'model s':>8} {'floor s':>8} {'x floor':>7} "
                  f"{'MB/step':>8} {'x none':>7}")
            for c, r in results.items():
                base = results.get(baseline(c))  # each framework against its own uncompressed run
                model = model_seconds(r, c, ranks, measured_link) if measured_link else None
                floor = floor_seconds(r, c, ranks, measured_link)
                row = dict(r, compression=c, rate=rate or "uncapped", model_step=model, floor_step=floor,
                           step_ratio=r["step_median"] / base["step_median"] if base else None,
                           bytes_ratio=r["tx_bytes_per_step"] / base["tx_bytes_per_step"] if base else None)
                rows.append(row)
                model_text = f"{model:8.3f}" if model else f"{'-':>8}"  # uncapped: no link rate to model
                print(f"{c:>18} {r['step_median']:8.3f} {row['step_ratio'] or 0:7.2f} {model_text} {floor:8.3f} "
                      f"{r['step_median'] / floor:7.2f} {r['tx_bytes_per_step'] / 1e6:8.2f} {row['bytes_ratio'] or 0:7.3f}",
                      flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
