"""Time to accuracy: wall-clock time to a held-out quality fixed in advance, hvd_aps against what
a user would pick instead (DDP's allreduce, torch's fp16/bf16 hooks and PowerSGD hook, Horovod in
fp32 and fp16), every peer from the same seed, data order and step budget.

One run (any launcher; rank 0 prints one JSON line: its log of wall time, step, training loss and
held-out quality, and the bytes a rank's interface sent per step):

    torchrun --nproc-per-node 2 examples/time_to_accuracy.py --peer ddp:aps-e4m3 --task wide-mlp
    horovodrun -np 2 -H localhost:2 --gloo python examples/time_to_accuracy.py --peer hvd:aps-e4m3

The grid in the bandwidth-limited cluster of examples/netns_cluster.py (root), peers in alternating
order within every seed, a table (wall time to the target, final quality, steps/s, bytes per step)
and one figure per task (held-out quality against wall time, a panel per link):

    sudo .venv/bin/python examples/time_to_accuracy.py --cluster --tasks wide-mlp --hosts 2 \\
        --rates 1gbit,10gbit --seeds 0,1,2 --out results/tta

Peers: ddp:none (DDP's allreduce), ddp:allreduce, ddp:fp16, ddp:bf16 (torch's hooks), ddp:powersgd1 and
ddp:powersgd4 (torch's powerSGD_hook at that rank, plain allreduce for the first tenth of the
steps: its documented warm-up), ddp:<recipe> (hvd_aps.ddp.aps_hook); hvd:none, hvd:fp16,
hvd:<recipe> (horovod.torch.DistributedOptimizer with Horovod's or hvd_aps's compression, after
a plain hvd.init()); diloco:none, diloco:<recipe> and diloco:intellect1-int8 (hvd_aps.diloco.DiLoCo
over torch.distributed, its outer exchange in float32, the recipe's codes or INTELLECT-1's uint8
ring, hvd_aps.diloco_peers.Intellect1Int8Ring, every --sync-every steps) and streaming:<...>
(the same with --fragments fragments, each exchange applied --delay steps later, --mix of those
steps' progress kept). Recipes: hvd_aps.RECIPES (aps-e4m3, aps-e3m0-ef, aps-e3m0-hybrid,
aps-e4m3-auto, ...). Threads are the framework's own. Evaluation pauses the clock on every rank;
DiLoCo's runs report rank 0's own parameters (between syncs each worker's differ).
"""
import argparse
import contextlib
import dataclasses
import json
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmark_common import tx_bytes
from digits_torch import cnn, digits
import recipes
from study_tasks import StdlibText

POWERSGD_PREFIX = "powersgd"
POWERSGD_WARMUP = 0.1  # of the steps: plain allreduce first, as torch's PowerSGD docs advise
# ddp:bf16 (torch's bf16_compress_hook) runs only with CUDA and NCCL (torch 2.13 refuses it on Gloo)
DDP_PEERS = ["ddp:none", "ddp:fp16", "ddp:powersgd1", "ddp:powersgd4", "ddp:aps-e4m3",
             "ddp:aps-e3m0-ef", "ddp:aps-e3m0-hybrid", "ddp:aps-e4m3-auto"]
# torch's powerSGD_hook issues its second allreduce from a future's callback: with several buckets
# on Gloo, which matches collectives by issue order, the ranks' orders can differ (a size mismatch
# or a hang at the first compressed step). One bucket keeps one order.
ONE_BUCKET_MB = 1024
PANELS_PER_ROW = 3  # the figures' panels (one a cluster and link), in rows of this many
INT8_RING = "intellect1-int8"  # diloco:intellect1-int8: INTELLECT-1's outer exchange, on the wire
HOROVOD_PEERS = ["hvd:none", "hvd:fp16", "hvd:aps-e4m3", "hvd:aps-e3m0-ef", "hvd:aps-e3m0-hybrid", "hvd:aps-e4m3-auto"]


@dataclasses.dataclass(frozen=True)
class Task:
    """A training task: model, data, optimizer, step budget, and the held-out quality it must reach,
    fixed before the grid from fp32's final quality (DDP's allreduce, 2 ranks on loopback, seed 0)
    less the tolerance: accuracy 0.5 points (digits-cnn and wide-mlp: 0.9777 -> 0.972), loss 1 %
    (transformer: 2.0395 -> 2.06)."""
    name: str
    steps: int
    global_batch: int
    eval_every: int
    target: float
    higher_is_better: bool  # accuracy: higher; loss: lower
    quality_name: str

    def reached(self, quality):
        return quality >= self.target if self.higher_is_better else quality <= self.target


class DigitsCNN:
    """The digits example's CNN on scikit-learn's digits, SGD with momentum; quality: test accuracy."""
    task = Task("digits-cnn", steps=240, global_batch=64, eval_every=5, target=0.972, higher_is_better=True,
                quality_name="test accuracy")

    def __init__(self):
        self.train, self.test = digits(0, 1)

    def model(self):
        return cnn()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def batch(self, gen):
        x, y = self.train
        idx = torch.randint(len(x), (self.task.global_batch,), generator=gen)
        return x[idx], y[idx]

    def loss(self, model, x, y):
        return F.cross_entropy(model(x), y)

    def quality(self, model):
        x, y = self.test
        with torch.no_grad():
            return (model(x).argmax(1) == y).float().mean().item()


class WideMLP(DigitsCNN):
    """The same digits through an MLP of two 2048-wide hidden layers (4.3M parameters): at
    1 Gbit/s fp32's step is mostly wire, so the network decides."""
    task = Task("wide-mlp", steps=300, global_batch=64, eval_every=10, target=0.972, higher_is_better=True,
                quality_name="test accuracy")
    HIDDEN = 2048

    def model(self):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, self.HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(self.HIDDEN, self.HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(self.HIDDEN, 10))

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class ByteTransformer:
    """The accuracy study's byte-level transformer LM on the standard library's source, AdamW;
    quality: held-out loss (nats per byte)."""
    task = Task("transformer", steps=300, global_batch=64, eval_every=20, target=2.06, higher_is_better=False,
                quality_name="held-out loss")

    def __init__(self):
        self.study = StdlibText()
        self.train, self.test = self.study.data()

    def model(self):
        return self.study.model()

    def optimizer(self, params):
        return self.study.optimizer(params, self.study.lr)

    def batch(self, gen):
        return self.study.batch(self.train, gen)

    def loss(self, model, x, y):
        return self.study.loss(model, x, y)

    def quality(self, model):
        return self.study.evaluate(model, *self.test)[1]


TASKS = {t.task.name: t for t in (DigitsCNN, WideMLP, ByteTransformer)}


class DDPRun:
    """torch.distributed over Gloo; the peer's communication hook on DDP."""

    def __init__(self, peer, model, steps, **_):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from pytorch_ddp_digits import register
        dist.init_process_group("gloo")
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()
        powersgd = peer.startswith(POWERSGD_PREFIX)
        self.model = DDP(model, bucket_cap_mb=ONE_BUCKET_MB if powersgd else None)
        if powersgd:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(peer[len(POWERSGD_PREFIX):]),
                                                start_powerSGD_iter=max(2, int(steps * POWERSGD_WARMUP)))
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            register(self.model, peer)

    def wrap(self, opt, named_parameters):
        return opt

    def gather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def close(self):
        self.dist.barrier()  # no rank tears Gloo down while another still talks
        self.dist.destroy_process_group()


class HorovodRun:
    """horovod.torch after a plain hvd.init(); the peer's compression on Horovod's optimizer."""

    def __init__(self, peer, model, steps, **_):
        import horovod.torch as hvd
        hvd.init()
        self.hvd, self.rank, self.size, self.peer, self.model = hvd, hvd.rank(), hvd.size(), peer, model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def wrap(self, opt, named_parameters):
        compression = recipes.compression(self.peer, self.hvd.Compression)
        opt = self.hvd.DistributedOptimizer(opt, named_parameters=named_parameters, compression=compression)
        self.hvd.broadcast_optimizer_state(opt, root_rank=0)
        return opt

    def gather(self, obj):
        return self.hvd.allgather_object(obj)

    def close(self):
        self.hvd.shutdown()


class DiLoCoRun:
    """torch.distributed over Gloo, no DDP: every worker steps alone, hvd_aps.diloco.DiLoCo syncs
    them (the options: DiLoCo's keywords)."""

    def __init__(self, peer, model, steps, **options):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.dist, self.rank, self.size, self.peer, self.model = dist, dist.get_rank(), dist.get_world_size(), peer, model
        self.options = options
        for p in model.parameters():  # the same start everywhere, as DDP's broadcast gives
            dist.broadcast(p.data, 0)

    def wrap(self, opt, named_parameters):
        import hvd_aps.diloco
        import hvd_aps.diloco_peers
        if self.peer == INT8_RING:
            compression = hvd_aps.diloco_peers.Intellect1Int8Ring()
        else:
            compression = None if self.peer == "none" else recipes.compression(self.peer)
        return hvd_aps.diloco.DiLoCo(self.model, opt, compression=compression, **self.options)

    gather, close = DDPRun.gather, DDPRun.close


FRAMEWORKS = {"ddp": DDPRun, "hvd": HorovodRun, "diloco": DiLoCoRun, "streaming": DiLoCoRun}


@contextlib.contextmanager
def paused(clock):
    """Time inside the block is left off clock["wall"]."""
    start = time.perf_counter()
    yield
    clock["paused"] += time.perf_counter() - start


def train(args):
    """One peer, one seed: train args.task for its step budget; rank 0 prints the JSON line."""
    work = TASKS[args.task]()
    task = dataclasses.replace(work.task, steps=args.steps or work.task.steps)
    framework, _, peer = args.peer.partition(":")
    torch.manual_seed(args.seed)  # the same initial model on every rank and for every peer
    run = FRAMEWORKS[framework](peer, work.model(), task.steps, **diloco_options(framework, args))
    model = run.model
    plain = getattr(model, "module", model)
    opt = run.wrap(work.optimizer(plain.parameters()), plain.named_parameters())
    if task.global_batch % run.size:
        raise SystemExit(f"{task.global_batch} samples a step do not split over {run.size} ranks")
    gen = torch.Generator().manual_seed(args.seed)  # the same data order for every peer and world size
    log, clock, sent = [], {"paused": 0.0}, tx_bytes(args.iface)
    start = time.perf_counter()
    for step in range(1, task.steps + 1):
        x, y = (t[run.rank::run.size] for t in work.batch(gen))
        opt.zero_grad()
        loss = work.loss(model, x, y)
        loss.backward()
        opt.step()
        if step % task.eval_every == 0 or step == task.steps:
            with paused(clock):
                wall = time.perf_counter() - start - clock["paused"]
                log.append({"wall": wall, "step": step, "loss": loss.item(), "quality": work.quality(plain)})
                if run.rank == 0 and args.progress:
                    print(f"{args.peer} step {step} {wall:.1f} s {task.quality_name} {log[-1]['quality']:.4f}",
                          file=sys.stderr, flush=True)
    per_rank = run.gather((tx_bytes(args.iface) - sent) / task.steps)
    if run.rank == 0:
        print(json.dumps({"peer": args.peer, "task": task.name, "seed": args.seed, "ranks": run.size,
                          "params": sum(p.numel() for p in plain.parameters()), "log": log,
                          "tx_bytes_per_step": statistics.mean(per_rank)}), flush=True)
    run.close()


def diloco_options(framework, args) -> dict:
    """DiLoCo's keywords of a diloco: or streaming: run (none for the other frameworks)."""
    if framework == "diloco":
        return {"sync_every": args.sync_every}
    if framework == "streaming":
        return {"sync_every": args.sync_every, "fragments": args.fragments, "delay": args.delay, "mix": args.mix}
    return {}


def time_to_target(task, log):
    """Wall seconds at the first evaluation that met the target (None: never within the budget)."""
    return next((row["wall"] for row in log if task.reached(row["quality"])), None)


def summary(task, runs):
    """One peer's runs (seeds) -> the table's row: medians, and the spread of the time to target."""
    times = [time_to_target(task, r["log"]) for r in runs]
    reached = sorted(t for t in times if t is not None)
    if len(reached) >= 5:  # MLPerf: drop the fastest and the slowest
        reached = reached[1:-1]
    return {"reached": f"{sum(t is not None for t in times)}/{len(times)}",
            "tta_median": statistics.median(reached) if len(reached) * 2 > len(times) else None,
            "tta_min": min(reached, default=None), "tta_max": max(reached, default=None),
            "final_quality": statistics.median(r["log"][-1]["quality"] for r in runs),
            "steps_per_s": statistics.median(r["log"][-1]["step"] / r["log"][-1]["wall"] for r in runs),
            "bytes_per_step": statistics.median(r["tx_bytes_per_step"] for r in runs)}


def print_table(task, label, runs_by_peer):
    rows = {peer: summary(task, runs) for peer, runs in runs_by_peer.items()}
    base = rows.get("ddp:none", {}).get("tta_median")
    print(f"\n{task.name}, {label}: target {task.quality_name} {'>=' if task.higher_is_better else '<='} "
          f"{task.target} (median over seeds; time to target needs more than half the seeds to reach it)")
    print(f"{'peer':>22} {'reached':>7} {'tta s':>7} {'x ddp fp32':>10} {'min-max s':>13} {'final':>7} "
          f"{'steps/s':>7} {'MB/step':>8}")
    for peer, r in rows.items():
        tta = r["tta_median"]
        spread = f"{r['tta_min']:.1f}-{r['tta_max']:.1f}" if r["tta_min"] is not None else "-"
        print(f"{peer:>22} {r['reached']:>7} {tta if tta else float('nan'):7.1f} "
              f"{tta / base if tta and base else float('nan'):10.2f} {spread:>13} {r['final_quality']:7.4f} "
              f"{r['steps_per_s']:7.2f} {r['bytes_per_step'] / 1e6:8.3f}", flush=True)
    return rows


def plot(path, task, panels):
    """Held-out quality against wall time, one panel per link, each peer's run of the median time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(PANELS_PER_ROW, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    peers = list(dict.fromkeys(peer for runs_by_peer in panels.values() for peer in runs_by_peer))
    colors = {peer: plt.get_cmap("tab20")(i % 20) for i, peer in enumerate(peers)}  # a peer's color in every panel
    for ax, (label, runs_by_peer) in zip(axes.flat, panels.items()):
        for peer, runs in runs_by_peer.items():
            run = sorted(runs, key=lambda r: r["log"][-1]["wall"])[len(runs) // 2]
            ax.plot([row["wall"] for row in run["log"]], [row["quality"] for row in run["log"]],
                    "-" if peer.startswith("ddp:aps") or peer.startswith("hvd:aps") else "--", label=peer,
                    color=colors[peer])
        ax.axhline(task.target, color="gray", lw=0.8)
        ax.set(xlabel="wall time, s (evaluation excluded)", ylabel=task.quality_name, title=f"{task.name}, {label}")
        if task.higher_is_better:
            ax.set_ylim(task.target - 0.1, 1.0)
        else:
            ax.set_ylim(task.target * 0.95, task.target * 1.4)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def grid(args):
    """Every (task, hosts, link), seeds outer, peers alternating inside: raw runs to
    <out>/runs.json after each run, tables to stdout, <out>/<task>.png at the end."""
    import netns_cluster
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
    tasks, hosts_, rates, seeds, peers = (args.tasks.split(","), args.hosts.split(","), args.rates.split(","),
                                          args.seeds.split(","), args.peers.split(","))
    progress = tqdm(total=len(tasks) * len(hosts_) * len(rates) * len(seeds) * len(peers), unit="run")
    for task_name in tasks:
        task = TASKS[task_name].task
        for hosts in (int(h) for h in hosts_):
            for rate in rates:
                label = f"{hosts}x{args.ranks_per_host} {rate}" + (f", {args.steps} steps" if args.steps else "")
                with netns_cluster.cluster(hosts, None if rate == "uncapped" else rate) as names:
                    for seed in (int(s) for s in seeds):
                        for peer in peers:
                            progress.set_description(f"{task_name} {label} seed {seed}")
                            progress.set_postfix_str(peer)
                            argv = [pathlib.Path(__file__).name, "--peer", peer, "--task", task_name,
                                    "--seed", str(seed), "--iface", "hvd0", "--sync-every", str(args.sync_every),
                                    "--fragments", str(args.fragments), "--delay", str(args.delay),
                                    "--mix", str(args.mix)] + (["--steps", str(args.steps)] if args.steps else [])
                            started = time.time()
                            try:
                                result = netns_cluster.launch(names, args.ranks_per_host, argv, args.timeout,
                                                              label=peer)[-1]
                            except (RuntimeError, subprocess.TimeoutExpired) as failed:  # the others still run
                                print(f"{label} seed {seed} {peer} failed: {str(failed)[-1500:]}", file=sys.stderr)
                            else:
                                runs.append(dict(result, label=label))
                                print(f"{label} seed {seed} {peer}: {time.time() - started:.0f} s, time to target "
                                      f"{time_to_target(task, result['log'])}", file=sys.stderr, flush=True)
                                (out / "runs.json").write_text(json.dumps(runs))
                            progress.update()
    report(runs, out)


def report(runs, out):
    """Tables and figures from the raw runs (also: --report on a saved runs.json)."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for task_name in dict.fromkeys(r["task"] for r in runs):
        task, panels = TASKS[task_name].task, {}
        for r in (r for r in runs if r["task"] == task_name):
            panels.setdefault(r["label"], {}).setdefault(r["peer"], []).append(r)
        for label, by_peer in panels.items():
            summaries[f"{task_name} {label}"] = print_table(task, label, by_peer)
        plot(out / f"{task_name}.png", task, panels)
    (out / "summary.json").write_text(json.dumps(summaries, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default="ddp:aps-e4m3", help="one run: framework:compression (see above)")
    parser.add_argument("--task", choices=sorted(TASKS), default="wide-mlp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="step budget (default: the task's); the target stays the task's")
    parser.add_argument("--iface", default="", help="network interface whose tx counter to read")
    parser.add_argument("--progress", action="store_true", help="rank 0 prints every evaluation")
    parser.add_argument("--sync-every", type=int, default=20, help="diloco:/streaming: inner steps between syncs")
    parser.add_argument("--fragments", type=int, default=4, help="streaming: fragments")
    parser.add_argument("--delay", type=int, default=2, help="streaming: inner steps an exchange runs beside")
    parser.add_argument("--mix", type=float, default=0.5, help="streaming: weight of those steps' progress kept")
    parser.add_argument("--cluster", action="store_true", help="run the grid in network namespaces (root)")
    parser.add_argument("--tasks", default="wide-mlp,transformer,digits-cnn")
    parser.add_argument("--peers", default=",".join(DDP_PEERS + HOROVOD_PEERS))
    parser.add_argument("--hosts", default="2")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc tbf rates between hosts; uncapped: none")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", default="results/tta")
    parser.add_argument("--report", help="only print the tables and draw the figures of this runs.json")
    args = parser.parse_args()
    if args.report:
        return report(json.loads(pathlib.Path(args.report).read_text()), pathlib.Path(args.out))
    if args.cluster:
        return grid(args)
    train(args)


if __name__ == "__main__":
    main()
