"""A bandwidth-limited cluster on one machine: one network namespace per host, veth links into a
bridge in a switch namespace, each link capped with `tc tbf`, --ranks-per-host ranks in every host
namespace (ranks of one host talk over its own stack; only traffic between hosts crosses the
capped link). Runs examples/pytorch_synthetic_benchmark.py for each compression (a "tf:" prefix
runs examples/tensorflow2_synthetic_benchmark.py, "ddp:" pytorch_ddp_synthetic_benchmark.py with
torch.distributed ranks, "fsdp:" pytorch_fsdp_synthetic_benchmark.py), --repeats times each in
alternating order, and prints the median step and the bytes leaving a host per step beside
uncompressed and 16-bit peers of the same framework and the floor (examples/perf_model_check.py
holds the performance model, hvd_aps.perf, against these runs). Needs
root (ip netns, tc); removes everything it made.

    sudo .venv/bin/python examples/netns_cluster.py [--hosts 2,4] [--ranks-per-host 1] \\
        [--rates 1gbit,10gbit,none] [--profile mlp] [--repeats 3] [--quick]

All traffic stays inside the namespaces this script creates (10.77.0.0/24).
"""
import argparse
import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

from tqdm import tqdm

import hvd_aps
from hvd_aps import perf

import recipes

EXAMPLES = pathlib.Path(__file__).parent
# none, fp16: the framework's own; aps-*: APSCompressor on horovod.torch.DistributedOptimizer;
# codes-*: hvd_aps.torch.DistributedOptimizer (examples/recipes.py)
COMPRESSIONS = ["none", "fp16", "aps-e4m3", "aps-e3m0", "codes-e4m3", "ddp:none", "ddp:fp16", "ddp:aps-e4m3"]
# every name this run makes carries its process id: two runs on one machine never meet (veth names
# stay within the kernel's 15 characters)
RUN = f"hvdaps-{os.getpid()}"
SWITCH, SUBNET, SERVER_IP = f"{RUN}-sw", "10.77.0", "10.77.0.254"
DDP_PORT = 29500
BENCHMARKS = {"": "pytorch_synthetic_benchmark.py", "tf": "tensorflow2_synthetic_benchmark.py",
              "ddp": "pytorch_ddp_synthetic_benchmark.py", "fsdp": "pytorch_fsdp_synthetic_benchmark.py",
              "pp": "model_parallel_benchmark.py --layout pipeline", "tp": "model_parallel_benchmark.py --layout tensor"}
MODEL_PARALLEL = ("pp", "tp")  # their bytes go by layer, not by a gradient: no floor of the wire
OMP_WAIT_POLICY = "PASSIVE"  # see rank_env
UNCOMPRESSED = ("none", "fp16")  # each framework's peers: its own allreduce in fp32 and in 16 bits
COMMAND_S = 30  # an ip or tc command
CALIBRATED = ("horovod", "torch")  # --calibrate: a job of each framework, as horovodrun and torchrun start them
SERVE_S = 60    # the rendezvous server's start, up to the port it prints, and its end
DRAIN_S = 5     # what a rank's pipes get to be read once the job's bound has passed


def sh(*cmd, ns=None, check=True):
    """Run an ip or tc command within COMMAND_S; check: a failure (or a command past it) raises,
    else it is returned (a command past it as exit code -9: cleanup goes on)."""
    full = (["ip", "netns", "exec", ns] if ns else []) + [str(c) for c in cmd]
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=COMMAND_S)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(full, -9, "", f"ran past {COMMAND_S} s")
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(full)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _host(host):
    """Host `host`'s namespace."""
    return f"{RUN}-h{host}"


def _link(host):
    """Host `host`'s veth: its end in the host namespace is renamed hvd0, its switch end adds "s"."""
    return f"hvd{os.getpid()}h{host}"


def cap(host, rate, queue="100ms", change=False):
    """Both directions of host `host`'s link capped at `rate` (None: uncapped); change: a cap set
    before is replaced (a running job sees its link change)."""
    for dev, where in (("hvd0", _host(host)), (f"{_link(host)}s", SWITCH)):
        if change:
            sh("tc", "qdisc", "del", "dev", dev, "root", ns=where, check=False)  # none set: nothing to remove
        if rate:
            sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", queue,
               ns=where)


@contextlib.contextmanager
def cluster(hosts, rate, queue="100ms"):
    """Namespaces <RUN>-h0.. with address 10.77.0.(i+1) on iface hvd0, bridged in the switch
    namespace; both directions of every link capped at `rate` (None: uncapped)."""
    names = [_host(i) for i in range(hosts)]
    links = [_link(i) for i in range(hosts)]
    try:
        sh("ip", "netns", "add", SWITCH)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=SWITCH)
        sh("ip", "addr", "add", f"{SERVER_IP}/24", "dev", "br0", ns=SWITCH)
        sh("ip", "link", "set", "br0", "up", ns=SWITCH)
        sh("ip", "link", "set", "lo", "up", ns=SWITCH)
        for i, ns in enumerate(names):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", links[i], "type", "veth", "peer", "name", f"{links[i]}s")
            sh("ip", "link", "set", links[i], "netns", ns, "name", "hvd0")
            sh("ip", "link", "set", f"{links[i]}s", "netns", SWITCH)
            sh("ip", "link", "set", f"{links[i]}s", "master", "br0", "up", ns=SWITCH)
            sh("ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "hvd0", ns=ns)
            sh("ip", "link", "set", "hvd0", "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            cap(i, rate, queue)
            # Gloo contexts (Horovod's process sets, torch.distributed) resolve the machine's
            # hostname: map it to this host's address
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


def serve_rendezvous(hosts, per_host):
    """Run inside the switch namespace: Horovod's own rendezvous server, per_host ranks a host."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(False)
    port = server.start()
    server.init(get_host_assignments(parse_hosts(",".join(f"host{i}:{per_host}" for i in range(hosts))),
                                     hosts * per_host))
    print(port, flush=True)
    sys.stdin.read()  # until the driver closes the pipe


def rank_env(host, local, hosts, per_host, port):
    """What horovodrun and torchrun would give rank (host, local): Horovod's rendezvous and
    topology, torch.distributed's RANK / LOCAL_RANK / GROUP_RANK. Threads stay the frameworks'
    and the codec's own choice (--benchmark-args '--threads 1' for one intra-op thread a rank).
    OpenMP's idle workers wait passively (OMP_WAIT_POLICY, unless the caller's environment sets
    it): every simulated host shares this machine's cores, and a rank's spinning workers took the
    cores another host's rank computes on (DDP's float32 step on the wide MLP at 10 Gbit/s: 100 ms
    spinning, 52 ms passive), which a cluster of separate machines would not see."""
    rank = host * per_host + local
    return dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", OMP_WAIT_POLICY),
                HOROVOD_HOSTNAME=f"host{host}", HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(hosts * per_host),
                HOROVOD_LOCAL_RANK=str(local), HOROVOD_LOCAL_SIZE=str(per_host), HOROVOD_CROSS_RANK=str(host),
                HOROVOD_CROSS_SIZE=str(hosts), HOROVOD_GLOO_RENDEZVOUS_ADDR=SERVER_IP,
                HOROVOD_GLOO_RENDEZVOUS_PORT=port, HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                HOROVOD_GLOO_IFACE="hvd0", TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONFAULTHANDLER="1",  # a rank that crashes prints its threads' Python stacks
                # torch.distributed's Gloo finds its address through the hostname (/etc/netns/<ns>/hosts);
                # GLOO_SOCKET_IFNAME=hvd0 crashed it (SIGSEGV) inside the namespaces
                MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(DDP_PORT), RANK=str(rank),
                WORLD_SIZE=str(hosts * per_host), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host),
                GROUP_RANK=str(host))


def launch(names, per_host, argv, timeout, rank_prefix="", label="", torch_only=False):
    """Run the example `argv` (a script in examples/ and its arguments, or -m and a module) as every rank of the
    cluster, per_host ranks in each host namespace, Horovod's rendezvous served from the switch
    namespace; returns rank 0's JSON lines (whatever a rank_prefix command prints around them).
    torch_only: the ranks see torchrun's variables alone, not Horovod's (what decides which
    framework a program that takes either runs, as `calibrate --links` does).
    rank_prefix: a command every rank runs under, {rank} and {compression} (label) filled in."""
    server = subprocess.Popen(["ip", "netns", "exec", SWITCH, sys.executable, __file__, "--serve",
                               f"{len(names)},{per_host}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = []
    try:
        if not select.select([server.stdout], [], [], SERVE_S)[0]:
            raise RuntimeError(f"the rendezvous server printed no port within {SERVE_S} s")
        port = server.stdout.readline().strip()
        for host, ns in enumerate(names):
            for local in range(per_host):
                prefix = rank_prefix.format(rank=host * per_host + local, compression=label).split()
                program = argv if argv[0] == "-m" else [str(EXAMPLES / argv[0]), *argv[1:]]
                cmd = ["ip", "netns", "exec", ns, *prefix, sys.executable, *program]
                env = rank_env(host, local, len(names), per_host, port)
                if torch_only:
                    env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}
                procs.append(subprocess.Popen(cmd, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout  # one bound for the job, not one a rank in turn
        outs = [p.communicate(timeout=max(DRAIN_S, deadline - time.monotonic())) for p in procs]
        failed = [f"rank {rank} failed ({p.returncode}):\n{out[-1000:]}\n{_without_module_list(err)[-3000:]}"
                  for rank, (p, (out, err)) in enumerate(zip(procs, outs)) if p.returncode]
        if failed:  # every failed rank's own words: the first to fail is often not rank 0
            raise RuntimeError(f"{label}: " + "\n".join(failed))
        return [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            p.kill()
        server.stdin.close()
        try:
            server.wait(timeout=SERVE_S)
        except subprocess.TimeoutExpired:
            server.kill()


def _without_module_list(stderr: str) -> str:
    """A crashed rank's stderr without faulthandler's list of extension modules, which is longer
    than any tail kept and would leave out the stacks printed before it."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("Extension modules:"))


def run_job(names, compressions, args) -> dict:
    """One job of the compressions (several: Horovod's benchmark, a model each, their steps
    alternated) -> its row per compression."""
    framework = compressions[0].rpartition(":")[0]
    if len(compressions) > 1 and any(c.rpartition(":")[0] for c in compressions):
        raise SystemExit(f"--same-job runs Horovod's torch benchmark only, not {','.join(compressions)}")
    argv = [*BENCHMARKS[framework].split(), "--compression", ",".join(c.rpartition(":")[2] for c in compressions),
            "--iface", "hvd0", "--hidden", str(args.hidden),
            "--profile", args.profile, "--num-iters", str(args.iters), "--batch-size", str(args.batch_size),
            "--hierarchical", args.hierarchical]
    if args.chunk_bytes is not None:
        argv += ["--chunk-bytes", str(args.chunk_bytes)]
    rows = launch(names, args.ranks_per_host, argv + args.benchmark_args.split(), args.timeout, args.rank_prefix,
                  "+".join(c.replace(":", "_") for c in compressions))
    return dict(zip(compressions, rows[-len(compressions):]))


def jobs(compressions, args) -> list:
    """The jobs of one (hosts, rate): each a list of compressions, --repeats times in order."""
    return ([compressions] if args.same_job else [[c] for c in compressions]) * args.repeats


def repeated(names, compressions, args, progress):
    """Every compression --repeats times, in alternating order (a, b, c, a, b, c, ...), so slow
    drifts of a shared machine fall on all alike (--same-job: all in each job, their steps
    alternated there): per compression the runs' results, and the median step of them."""
    runs = {c: [] for c in compressions}
    for job in jobs(compressions, args):
        progress.set_postfix_str(",".join(job))
        for c, row in run_job(names, job, args).items():
            runs[c].append(row)
        progress.update()
    return {c: dict(rs[-1], step_median=statistics.median(r["step_median"] for r in rs),
                    step_runs=[r["step_median"] for r in rs],
                    tx_bytes_per_step=statistics.median(r["tx_bytes_per_step"] for r in rs),
                    cpu_per_step=statistics.median(r["cpu_per_step"] for r in rs),
                    cpu_threads_per_step={kind: statistics.median(r["cpu_threads_per_step"].get(kind, 0.0) for r in rs)
                                          for kind in rs[-1]["cpu_threads_per_step"]})
            for c, rs in runs.items()}


def wire_bytes_per_element(compression):
    """What one gradient element costs on the wire: 4 (fp32), 2 (fp16, float16 values), bits/8 (codes),
    0 (recipes.Tokens: a token a gradient and no exchange)."""
    name = compression.rpartition(":")[2]
    if name == recipes.FLOOR:
        return 0
    if name in UNCOMPRESSED or name == "bf16":
        return 4 if name == "none" else 2
    config = hvd_aps.recipe("aps-" + name[len("codes-"):] if name.startswith("codes-") else name)
    return 2 if config.wire == "values" else config.fmt.bits / 8


def ring_factor(compression, hosts, per_host):
    """Bytes leaving a host per step, in units of one rank's gradient at that many bytes per
    element: a ring allreduce (the frameworks' own, ranks in host order) 2 (N - 1) / N, whatever
    the ranks per host (only the ring's links between hosts cross); the flat codes exchange, whose
    alltoall and allgather go between every pair of ranks, 2 L (N - L) / N; the two-level exchange
    2 (H - 1) / H from the host as a whole."""
    n = hosts * per_host
    if compression.rpartition(":")[2] in UNCOMPRESSED:
        return 2 * (n - 1) / n
    if per_host > 1 and hosts > 1:  # two levels (the benchmarks' --hierarchical auto)
        return 2 * (hosts - 1) / hosts
    return 2 * per_host * (n - per_host) / n


FSDP_GATHER_BYTES = {"none": 4, "fp16": 4, "bf16-params": 2, "bf16": 2}  # FSDP's own gathers, bytes an element
FSDP_SCATTER_BYTES = {"none": 4, "fp16": 2, "bf16-params": 4, "bf16": 2}  # and its reduce-scatter's


def fsdp_bytes_per_element(compression, hosts, per_host):
    """Bytes leaving a host per parameter in an FSDP2 step of one rank a host: two all-gathers
    (resharding; the root's one, left out here) of (N-1)/N of the parameters, and the
    reduce-scatter: Gloo's (an allreduce's 2(N-1)/N) or the codes' alltoall ((N-1)/N)."""
    name = compression.rpartition(":")[2]
    grads, _, params = name.partition("+params-")
    share = (hosts * per_host - 1) / (hosts * per_host)
    gathers = 2 * share * (hvd_aps.FloatFormat.parse(params).bits / 8 if params else FSDP_GATHER_BYTES.get(grads, 4))
    if grads in FSDP_SCATTER_BYTES:
        return gathers + 2 * share * FSDP_SCATTER_BYTES[grads]
    return gathers + share * hvd_aps.recipe(grads).fmt.bits / 8


def floor_seconds(result, compression, hosts, per_host, link_bytes_per_s):
    """The fastest the step can be: what cannot overlap the exchange (forward, optimizer step)
    plus the larger of backward and the wire time of the bytes leaving a host (uncapped: compute
    alone). TF rows measure the step as a whole and count it all as overlappable; FSDP2's count
    its gathers' and reduce-scatter's bytes (fsdp_bytes_per_element); model parallelism's, their
    compute alone (MODEL_PARALLEL)."""
    if compression.rpartition(":")[0] in MODEL_PARALLEL:
        return result["compute"]
    per_element = (fsdp_bytes_per_element(compression, hosts, per_host) if compression.startswith("fsdp:") else
                   ring_factor(compression, hosts, per_host) * wire_bytes_per_element(compression))
    wire = result["params"] * per_element / link_bytes_per_s if link_bytes_per_s else 0.0
    fixed = result.get("forward", 0.0) + result.get("optimizer", 0.0)
    return fixed + max(result["compute"] - fixed, wire)


def peers(compression, results):
    """(this framework's uncompressed run, its fastest uncompressed run: fp32 or 16-bit)."""
    framework = compression.rpartition(":")[0]
    own = [results.get(f"{framework}:{p}" if framework else p) for p in UNCOMPRESSED + ("bf16",)]
    own = [r for r in own if r is not None]
    return (own[0] if own and own[0]["compression"] == "none" else None,
            min(own, key=lambda r: r["step_median"]) if own else None)


def tree() -> str:
    """The commit of the hvd_aps tree this run imports (PYTHONPATH may point at another checkout),
    "+" where its files differ from it: which code a row measured, for the model's check."""
    root = pathlib.Path(hvd_aps.__file__).resolve().parent.parent
    git = ("git", "-c", "safe.directory=*", "-C", root)  # run as root in a checkout someone else owns
    commit = sh(*git, "rev-parse", "--short", "HEAD", check=False).stdout.strip()
    dirty = sh(*git, "status", "--porcelain", "--untracked-files=no", check=False).stdout.strip()
    return (commit or "unknown") + ("+" if dirty else "")


def rate_bytes(rate):
    return None if rate is None else perf.Link.parse(rate).bandwidth


def table(results, hosts, per_host, rate, args):
    """Rows of the printed table (and the JSON rows)."""
    link = rate_bytes(rate)
    params = next(iter(results.values()))["params"]
    print(f"\n{hosts} hosts x {per_host} ranks, link {rate or 'uncapped'}, {args.profile} profile, {params} parameters "
          f"(median of {args.repeats} alternating runs of {args.iters} steps; bytes: a host's tx counter per step)")
    print(f"{'compression':>18} {'step s':>8} {'x none':>7} {'x best':>7} {'floor s':>8} "
          f"{'x floor':>7} {'MB/step':>8} {'x none':>7}  schedule")
    rows, measured_tree = [], tree()
    for c, r in results.items():
        none, best = peers(c, results)
        floor = floor_seconds(r, c, hosts, per_host, link)
        row = dict(r, compression=c, rate=rate or "uncapped", hosts=hosts, ranks_per_host=per_host,
                   tree=measured_tree, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", OMP_WAIT_POLICY),
                   floor_step=floor, step_ratio=r["step_median"] / none["step_median"] if none else None,
                   best_ratio=r["step_median"] / best["step_median"] if best else None,
                   bytes_ratio=r["tx_bytes_per_step"] / none["tx_bytes_per_step"] if none else None)
        rows.append(row)
        chosen = sorted({s["chosen"] or "undecided" for s in r.get("schedule") or []})
        print(f"{c:>18} {r['step_median']:8.3f} {row['step_ratio'] or 0:7.2f} {row['best_ratio'] or 0:7.2f} "
              f"{floor:8.3f} {r['step_median'] / floor:7.2f} "
              f"{r['tx_bytes_per_step'] / 1e6:8.2f} {row['bytes_ratio'] or 0:7.3f}  {', '.join(chosen)}", flush=True)
    cpu_table(rows)
    return rows


def cpu_table(rows):
    """CPU a step by kind of thread (examples/benchmark_common.thread_kind; the ranks' mean, the
    runs' median): on a machine whose cores the ranks share, what the steps cost beside their
    wall time."""
    kinds = list(rows[0]["cpu_threads_per_step"])
    print(f"\nCPU ms a step (a rank), by thread\n{'compression':>18} {'all':>6} " + " ".join(f"{k:>8}" for k in kinds))
    for row in rows:
        print(f"{row['compression']:>18} {1e3 * row['cpu_per_step']:6.1f} "
              + " ".join(f"{1e3 * row['cpu_threads_per_step'][k]:8.1f}" for k in kinds), flush=True)


def calibrate(names, hosts, rate, args, progress):
    """`python -m hvd_aps calibrate --links --entry-points` on every rank of this cluster, once as a
    horovodrun job and once as a torchrun job, each into a copy of the --calibrate file named for
    the cluster's shape, rate and framework (FILE's stem.HxL.RATE.FRAMEWORK.json): the link, each
    entry point's costs and the contention as a user's job measures them (every rank shares this
    machine's cores)."""
    source = pathlib.Path(args.calibrate).resolve()
    for framework in CALIBRATED:
        out = source.with_name(f"{source.stem}.{hosts}x{args.ranks_per_host}.{rate or 'uncapped'}.{framework}.json")
        shutil.copyfile(source, out)
        launch(names, args.ranks_per_host, ["-m", "hvd_aps", "calibrate", "--links", "--entry-points", "--sharing",
                                            str(hosts * args.ranks_per_host), "--out", str(out)], args.timeout,
               label=f"calibrate {framework}", torch_only=framework == "torch")
        print(f"{hosts} hosts x {args.ranks_per_host}, {rate or 'uncapped'}: {framework} calibrated into {out}",
              flush=True)
        progress.update()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4", help="host counts to run")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--rates", default="1gbit,10gbit,none", help="tc tbf rates; none = uncapped")
    parser.add_argument("--queue", default="100ms", help="tc tbf latency: how long a packet may wait in a "
                        "capped link's queue (a switch port's buffer; 100ms: deep)")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS))
    parser.add_argument("--profile", default="mlp", help="the benchmarks' profile (examples/synthetic_models.py)")
    parser.add_argument("--hidden", type=int, default=2048, help="mlp: 4 x hidden^2 parameters; transformer: width")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chunk-bytes", help="the compressors' chunk_bytes (default: auto, tuned at run time)")
    parser.add_argument("--hierarchical", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--benchmark-args", default="", help="further arguments for every benchmark script "
                        "(e.g. '--no-reshard' for fsdp: rows, '--image-size 64')")
    parser.add_argument("--rank-prefix", default="", help="a command every rank runs under, {rank} and "
                        "{compression} filled in (e.g. 'py-spy record --idle --threads -r 100 -f raw -o "
                        "prof.{compression}.{rank}.txt --' for examples/profile_split.py)")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of every compression")
    parser.add_argument("--same-job", action="store_true", help="every compression in one job (Horovod's torch "
                        "benchmark: a model each, their timed steps alternated), the machine's drifts between jobs "
                        "falling on all alike")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--quick", action="store_true", help="2 hosts at 1gbit, a 1M-parameter model, 3 steps")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--calibrate", help="in place of the benchmarks: a calibration file holding the codec's "
                        "(python -m hvd_aps calibrate); on each cluster every rank runs calibrate --links "
                        "--entry-points (its ranks sharing this machine) as a horovodrun and a torchrun job, each into a copy "
                        "of it, FILE's stem.HxL.RATE.FRAMEWORK.json")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_rendezvous(*(int(v) for v in args.serve.split(",")))
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and tc")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # still remove the namespaces
    if args.quick:
        args.hosts, args.rates, args.hidden, args.iters = "2", "1gbit", 512, 3
    rows = []
    shapes = [(int(h), None if r == "none" else r) for h in args.hosts.split(",") for r in args.rates.split(",")]
    per_shape = len(CALIBRATED) if args.calibrate else len(jobs(args.compressions.split(","), args))
    progress = tqdm(total=len(shapes) * per_shape, unit="job")
    for hosts, rate in shapes:
        progress.set_description(f"{hosts} hosts x {args.ranks_per_host}, {rate or 'uncapped'}")
        if args.calibrate:
            with cluster(hosts, rate, args.queue) as names:
                calibrate(names, hosts, rate, args, progress)
            continue
        with cluster(hosts, rate, args.queue) as names:
            results = repeated(names, args.compressions.split(","), args, progress)
        rows += table(results, hosts, args.ranks_per_host, rate, args)
        if args.json:  # after every table: a long run that stops early keeps what it measured
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
