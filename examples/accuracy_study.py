"""Accuracy study: does training with APS-compressed gradients reach fp32 accuracy?

Real ranks (Horovod, every setting and seed in one job; rank 0 writes the results):

    horovodrun -np 2 -H localhost:2 --gloo python examples/accuracy_study.py [--quick]

torch.distributed DDP ranks (hvd_aps.ddp.aps_hook; none/fp16 are DDP's allreduce and torch's hook):

    torchrun --nproc-per-node 2 examples/accuracy_study.py --ddp [--quick]

Many emulated workers in one process (hvd_aps.emulate, CPD's "emulate-node"):

    python examples/accuracy_study.py --emulate 8,32,256 [--quick]

Trains an MLP on scikit-learn's digits (ships with scikit-learn: nothing is downloaded) for each
setting and seed, and writes <out>/results.json, <out>/results.csv and <out>/curves.png.

The setting is made hard on purpose, the way large models make it hard: gradient entries there
are ~1e-5 and below. Here the loss is multiplied by --loss-scale (2**-4) and the learning rate
divided by it. For fp32 training that changes nothing, bit for bit (powers of two scale exactly,
and SGD with momentum is linear in the gradient), and APS is scale-invariant by construction; a
fixed-range cast is not: the largest gradient entries drop to ~3e-3, the median to ~6e-6, and a
naive e4m3 cast (smallest subnormal 2**-9 = 2e-3) flushes nearly all of them.
"""
import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvd_aps
from hvd_aps import emulate
from hvd_aps import from_name

# aps-*: the card's line (horovod.torch.DistributedOptimizer + APSCompressor), codes on the wire;
# *-values: the same rounding carried as float16 values; codes-*: hvd_aps.torch.DistributedOptimizer;
# *-ef: with error feedback
SETTINGS = ["none", "fp16", "naive-e4m3", "naive-e5m2", "aps-e4m3", "aps-e5m2", "aps-e3m0", "aps-e2m1fn",
            "aps-e4m3-values", "aps-e5m2-values", "aps-e3m0-values", "codes-e3m0-ef", "codes-e2m1fn-ef"]
QUICK_SETTINGS = ["none", "naive-e4m3", "aps-e4m3", "aps-e4m3-values", "codes-e3m0-ef", "codes-e2m1fn-ef"]
GLOBAL_BATCH = 256


def data(seed=0):
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    return (x[360:], y[360:]), (x[:360], y[:360])


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def evaluate(model, x, y):
    with torch.no_grad():
        logits = model(x)
        return (logits.argmax(1) == y).float().mean().item(), F.cross_entropy(logits, y).item()


class HorovodAverager:
    """Gradients averaged by horovod.torch.DistributedOptimizer through the setting's compressor,
    or, for codes-<format>, by hvd_aps.torch.DistributedOptimizer."""

    def __init__(self, setting, workers):
        import horovod.torch as hvd
        self.hvd, self.setting, self.workers = hvd, setting, workers
        self.codes = setting.startswith("codes-")
        self.compression = from_name(setting, hvd.Compression)

    def optimizer(self, model, lr):
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.sizes = [p.numel() for p in model.parameters()]
        if self.codes:
            import hvd_aps.torch
            return hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                      compression=self.compression)
        return self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                             compression=self.compression)

    def step(self, model, opt, x, y, loss_scale):
        rank, size = self.hvd.rank(), self.hvd.size()
        opt.zero_grad()
        (F.cross_entropy(model(x[rank::size]), y[rank::size]) * loss_scale).backward()
        opt.step()

    def bytes_per_step(self, n_params):
        """Payload one rank hands to the collectives per step (a ring moves 2(N-1)/N of it)."""
        if self.codes:  # the optimizer's own small tensors are not in the compressor's stats
            cfg = self.compression.config
            return sum(hvd_aps.packed_size(n, cfg.fmt) if n >= cfg.min_elements else 4 * n for n in self.sizes)
        if isinstance(self.compression, hvd_aps.APSCompressor):
            return self.compression.totals().bytes_carried // self.steps
        return n_params * (2 if self.setting == "fp16" else 4)


class DDPAverager:
    """Gradients averaged by torch.distributed DistributedDataParallel with the setting's hook:
    hvd_aps.ddp.aps_hook for aps-/naive-<format>, torch's fp16_compress_hook for fp16."""

    def __init__(self, setting, workers):
        self.setting, self.workers = setting, workers

    def optimizer(self, model, lr):
        from torch.nn.parallel import DistributedDataParallel
        from pytorch_ddp_digits import register
        self.ddp = DistributedDataParallel(model)
        self.compressor = register(self.ddp, self.setting)
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(self, model, opt, x, y, loss_scale):
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        opt.zero_grad()
        (F.cross_entropy(self.ddp(x[rank::size]), y[rank::size]) * loss_scale).backward()
        opt.step()

    def bytes_per_step(self, n_params):
        if self.compressor is not None:
            return self.compressor.totals().bytes_carried // self.steps
        return n_params * (2 if self.setting == "fp16" else 4)


class EmulatedAverager:
    """N workers in one process: per-worker gradients from torch.func, averaged by emulate.allreduce."""

    def __init__(self, setting, workers):
        self.setting, self.workers = setting, workers
        kind, _, fmt = setting.partition("-")
        self.fmt = {"none": None, "fp16": "fp16"}.get(setting, fmt)
        self.scaling = "aps" if kind == "aps" else "none"

    def optimizer(self, model, lr):
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(self, model, opt, x, y, loss_scale):
        params = dict(model.named_parameters())

        def loss(p, xs, ys):
            return F.cross_entropy(torch.func.functional_call(model, p, (xs,)), ys) * loss_scale

        xs = x.reshape(self.workers, -1, x.shape[1])
        ys = y.reshape(self.workers, -1)
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
        for name, p in params.items():
            per_worker = grads[name].detach().numpy()
            mean = (per_worker.mean(axis=0) if self.fmt is None else
                    emulate.allreduce(list(per_worker), self.fmt, scaling=self.scaling))
            p.grad = torch.from_numpy(np.ascontiguousarray(mean, np.float32))
        opt.step()

    def bytes_per_step(self, n_params):
        bits = 32 if self.fmt is None else hvd_aps.FloatFormat.parse(self.fmt).bits
        return n_params * bits // 8


def train(averager, seed, args, log):
    steps, eval_every = args.steps, args.eval_every
    torch.manual_seed(seed)
    (x, y), (x_test, y_test) = data()
    model = mlp()
    opt = averager.optimizer(model, args.lr / args.loss_scale)
    averager.steps = steps
    gen = torch.Generator().manual_seed(seed)
    curve = {"step": [], "test_accuracy": [], "train_loss": []}
    for step in range(1, steps + 1):
        idx = torch.randint(len(x), (GLOBAL_BATCH,), generator=gen)  # same batch on every rank
        averager.step(model, opt, x[idx], y[idx], args.loss_scale)
        if step % eval_every == 0 or step == steps:
            acc, _ = evaluate(model, x_test, y_test)
            _, train_loss = evaluate(model, x, y)
            curve["step"].append(step)
            curve["test_accuracy"].append(acc)
            curve["train_loss"].append(train_loss)
            log(f"  {averager.setting:>11} seed {seed} step {step:4d}: test accuracy {acc:.4f} train loss {train_loss:.4f}")
    params = torch.cat([p.detach().ravel() for p in model.parameters()])
    return curve, params, averager.bytes_per_step(params.numel())


def summarise(runs):
    rows = {}
    for setting, seeds in runs.items():
        accs = [r["curve"]["test_accuracy"][-1] for r in seeds]
        losses = [r["curve"]["train_loss"][-1] for r in seeds]
        rows[setting] = {"final_test_accuracy_mean": statistics.mean(accs),
                         "final_test_accuracy_std": statistics.pstdev(accs),
                         "final_test_accuracy": accs, "final_train_loss_mean": statistics.mean(losses),
                         "bytes_per_step_per_worker": seeds[0]["bytes"], "seeds": [r["seed"] for r in seeds]}
    return rows


def write(out, label, rows, runs):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"workers": label, "summary": rows, "runs": runs}, indent=1))
    lines = ["setting,workers,test_accuracy_mean,test_accuracy_std,train_loss_mean,bytes_per_step_per_worker"]
    lines += [f"{s},{label},{r['final_test_accuracy_mean']:.4f},{r['final_test_accuracy_std']:.4f},"
              f"{r['final_train_loss_mean']:.4f},{r['bytes_per_step_per_worker']}" for s, r in rows.items()]
    (out / "results.csv").write_text("\n".join(lines) + "\n")
    plot(out / "curves.png", label, runs)


def plot(path, label, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]  # settings that track fp32 overlap: keep each visible
    for i, (setting, seeds) in enumerate(runs.items()):
        steps = seeds[0]["curve"]["step"]
        acc = np.mean([r["curve"]["test_accuracy"] for r in seeds], axis=0)
        loss = np.mean([r["curve"]["train_loss"] for r in seeds], axis=0)
        color = plt.cm.tab20(i % 20)  # more settings than the default cycle has colours
        left.plot(steps, acc, styles[i % 4], label=setting, linewidth=1.6, color=color)
        right.plot(steps, loss, styles[i % 4], label=setting, linewidth=1.6, color=color)
    left.set(xlabel="step", ylabel="test accuracy", title=f"digits MLP, {label} workers (mean of seeds)")
    right.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_study(make_averager, settings, seeds, args, log):
    runs = {}
    for setting in settings:
        runs[setting] = []
        for seed in seeds:
            start = time.time()
            curve, params, nbytes = train(make_averager(setting), seed, args, log)
            runs[setting].append({"seed": seed, "curve": curve, "bytes": nbytes, "params": params,
                                  "seconds": time.time() - start})
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 settings, 2 seeds, 150 steps (CI size)")
    parser.add_argument("--emulate", help="comma-separated emulated worker counts, e.g. 8,32,256")
    parser.add_argument("--ddp", action="store_true", help="torch.distributed DDP ranks (run under torchrun)")
    parser.add_argument("--settings", help=f"comma-separated, default all: {','.join(SETTINGS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05, help="effective learning rate (after --loss-scale)")
    parser.add_argument("--loss-scale", type=float, default=2.0 ** -4,
                        help="multiplies the loss (the learning rate is divided by it): 2**-4 by default")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default="results/accuracy")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 2, 150
    settings = args.settings.split(",") if args.settings else (QUICK_SETTINGS if args.quick else SETTINGS)
    seeds = list(range(args.seeds))
    torch.set_num_threads(1)

    if args.emulate:
        # one emulated sum in float32 per setting: the wire paths (codes-*, *-values) need real ranks
        settings = [s for s in settings if not s.startswith("codes-") and not s.endswith("-values")]
        for workers in (int(w) for w in args.emulate.split(",")):
            if GLOBAL_BATCH % workers:
                parser.error(f"{workers} workers do not divide the global batch of {GLOBAL_BATCH}")
            print(f"{workers} emulated workers", flush=True)
            runs = run_study(lambda s: EmulatedAverager(s, workers), settings, seeds, args, print)
            finish(pathlib.Path(args.out) / f"emulated-{workers}", str(workers), runs)
        return

    if args.ddp:
        return ddp_main(settings, seeds, args)
    import horovod.torch as hvd
    hvd.init()
    if hvd.size() < 2 or GLOBAL_BATCH % hvd.size():
        raise SystemExit("run under horovodrun with >= 2 ranks that divide 256 (with one rank Horovod never compresses)")
    log = print if hvd.rank() == 0 else (lambda *_: None)
    log(f"{hvd.size()} Horovod ranks, settings {settings}, seeds {seeds}, {args.steps} steps")
    runs = run_study(lambda s: HorovodAverager(s, hvd.size()), settings, seeds, args, log)
    identical = all(bool(hvd.allreduce(r["params"], op=hvd.Max, name=f"id.{s}.{r['seed']}").eq(r["params"]).all())
                    and bool(hvd.allreduce(r["params"], op=hvd.Min, name=f"id2.{s}.{r['seed']}").eq(r["params"]).all())
                    for s, seeds_ in runs.items() for r in seeds_)
    if hvd.rank() == 0:
        finish(pathlib.Path(args.out) / f"horovod-{hvd.size()}", f"{hvd.size()} Horovod", runs,
               {"parameters_identical_on_all_ranks": identical})


def ddp_main(settings, seeds, args):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if size < 2 or GLOBAL_BATCH % size:
        raise SystemExit("run under torchrun with >= 2 ranks that divide 256")
    settings = [s for s in settings if not s.startswith("codes-") and not s.endswith("-values")]  # Horovod's paths
    log = print if rank == 0 else (lambda *_: None)
    log(f"{size} DDP ranks, settings {settings}, seeds {seeds}, {args.steps} steps")
    runs = run_study(lambda s: DDPAverager(s, size), settings, seeds, args, log)
    identical = True
    for seeds_ in runs.values():
        for r in seeds_:
            high, low = r["params"].clone(), r["params"].clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            identical = identical and bool(high.eq(r["params"]).all() and low.eq(r["params"]).all())
    if rank == 0:
        finish(pathlib.Path(args.out) / f"ddp-{size}", f"{size} DDP", runs, {"parameters_identical_on_all_ranks": identical})
    dist.barrier()  # no rank tears Gloo down while another still talks
    dist.destroy_process_group()


def finish(out, label, runs, extra=None):
    for seeds in runs.values():
        for r in seeds:
            r.pop("params")
    rows = summarise(runs)
    write(out, label, rows, runs)
    if extra:
        (out / "checks.json").write_text(json.dumps(extra))
    print(f"\n{'setting':>11}  test accuracy (mean +- std over seeds)  final train loss  bytes/step/worker")
    for setting, r in rows.items():
        print(f"{setting:>11}  {r['final_test_accuracy_mean']:.4f} +- {r['final_test_accuracy_std']:.4f}"
              f"{'':22}{r['final_train_loss_mean']:.4f}  {r['bytes_per_step_per_worker']:>10}")
    print(f"wrote {out}/results.json, results.csv, curves.png" + (f", checks.json {extra}" if extra else ""))


if __name__ == "__main__":
    main()
