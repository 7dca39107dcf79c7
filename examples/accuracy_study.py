"""Accuracy study: does training with APS-compressed gradients reach fp32's training loss?

Real ranks (Horovod, every setting and seed in one job; rank 0 writes the results):

    horovodrun -np 2 -H localhost:2 --gloo python examples/accuracy_study.py [--task transformer] [--quick]

torch.distributed DDP ranks (hvd_aps.ddp.aps_hook; none/fp16 are DDP's allreduce and torch's hook),
or FSDP2 ranks (hvd_aps.fsdp; none is FSDP's own reduce-scatter):

    torchrun --nproc-per-node 2 examples/accuracy_study.py --ddp [--quick]
    torchrun --nproc-per-node 2 examples/accuracy_study.py --fsdp --task transformer --settings none,aps-e4m3

FSDP2 settings may add how the parameters are gathered: `<setting>+params-<format>` gathers them
as codes (hvd_aps.fsdp.apply(params=<format>); `<format>/<block>`: an exponent a block of that many,
hvd_aps.BlockCodes(format, block)), `<setting>+params-bf16` in bfloat16 (FSDP's own all-gather
under MixedPrecisionPolicy(param_dtype=torch.bfloat16), reductions in float32), e.g.
`none+params-bf16,aps-e4m3+params-e4m3,aps-e4m3+params-e2m1fn/32`.

Many emulated workers in one process (CPD's "emulate-node"): the codes settings run the
driver real ranks run (hvd_aps.emulate.codes_allreduce, one compressor per worker), the -values
settings one rounding and a float32 sum (hvd_aps.emulate.allreduce):

    python examples/accuracy_study.py --emulate 8,32 [--task transformer] [--quick]

Tasks (examples/study_tasks.py): `digits`, an MLP on scikit-learn's digits with SGD, and
`transformer`, a byte-level transformer LM with AdamW on the Python standard library's source.
Writes <out>/<task>-<workers>/results.json, results.csv and curves.png (test accuracy, training
loss, and rank 0's relative encode error ||q(g) - g|| / ||g|| from the compressor's telemetry).

The digits setting is made hard on purpose, the way large models make it hard: gradient entries
there are ~1e-5 and below. The loss is multiplied by --loss-scale (2**-4) and the learning rate
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
from tqdm import tqdm

import hvd_aps
from hvd_aps import emulate
import recipes
from study_tasks import TASKS

# aps-*: APSCompressor on horovod.torch.DistributedOptimizer, codes on the wire;
# *-values: the same rounding carried as float16 values; codes-*: hvd_aps.torch.DistributedOptimizer;
# -ef: with error feedback; -hybrid: hybrid precision (tensors the format would lose go in e4m3)
SETTINGS = ["none", "fp16", "naive-e4m3", "naive-e5m2", "aps-e4m3", "aps-e5m2", "aps-e3m0", "aps-e2m1fn",
            "aps-e4m3-values", "aps-e5m2-values", "aps-e3m0-values", "aps-e4m3-ef", "aps-e5m2-ef",
            "codes-e3m0-ef", "codes-e2m1fn-ef", "codes-e3m0-hybrid", "codes-e2m1fn-hybrid"]
QUICK_SETTINGS = {"digits": ["none", "naive-e4m3", "aps-e4m3", "aps-e4m3-values", "codes-e3m0-ef", "codes-e2m1fn-ef"],
                  "transformer": ["none", "naive-e4m3", "aps-e4m3", "codes-e3m0-ef", "codes-e3m0-hybrid"]}


class HorovodAverager:
    """Gradients averaged by horovod.torch.DistributedOptimizer through the setting's compressor,
    or, for codes-<format>, by hvd_aps.torch.DistributedOptimizer."""

    def __init__(self, setting, task, options):
        import horovod.torch as hvd
        self.hvd, self.setting, self.task = hvd, setting, task
        self.codes = setting.startswith("codes-")
        self.compression = recipes.compression(setting, hvd.Compression, **options)
        self.compressor = self.compression if isinstance(self.compression, hvd_aps.APSCompressor) else None

    def optimizer(self, model, lr):
        opt = self.task.optimizer(model.parameters(), lr)
        if self.codes:
            import hvd_aps.torch
            return hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                      compression=self.compression)
        return self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                             compression=self.compression)

    def step(self, model, opt, x, y, loss_scale):
        rank, size = self.hvd.rank(), self.hvd.size()
        opt.zero_grad()
        (self.task.loss(model, x[rank::size], y[rank::size]) * loss_scale).backward()
        opt.step()

    def bytes_per_step(self, n_params):
        """Payload one rank hands to the collectives per step (a ring moves 2(N-1)/N of it)."""
        if self.compressor is None:
            return n_params * (2 if self.setting == "fp16" else 4)
        return self.compressor.totals().bytes_carried // self.steps


class DDPAverager:
    """Gradients averaged by torch.distributed DistributedDataParallel with the setting's hook:
    hvd_aps.ddp.aps_hook for aps-/naive-<format>, torch's fp16_compress_hook for fp16."""

    def __init__(self, setting, task, options):
        self.setting, self.task, self.options = setting, task, options

    def optimizer(self, model, lr):
        from torch.nn.parallel import DistributedDataParallel
        from pytorch_ddp_digits import register
        self.ddp = DistributedDataParallel(model)
        self.compressor = register(self.ddp, self.setting, **self.options)
        return self.task.optimizer(model.parameters(), lr)

    def step(self, model, opt, x, y, loss_scale):
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        opt.zero_grad()
        (self.task.loss(self.ddp, x[rank::size], y[rank::size]) * loss_scale).backward()
        opt.step()

    def bytes_per_step(self, n_params):
        if self.compressor is not None:
            return self.compressor.totals().bytes_carried // self.steps
        return n_params * (2 if self.setting == "fp16" else 4)


class FSDPAverager(DDPAverager):
    """Gradients reduce-scattered by FSDP2 (each transformer block a unit, then the root): FSDP's
    own reduce-scatter for none, hvd_aps.fsdp's codes reduce-scatter for an APS setting; the
    parameters gathered exactly, in bfloat16 (+params-bf16) or as codes (+params-<format>)."""

    def optimizer(self, model, lr):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        import hvd_aps.fsdp
        grads, _, params = self.setting.partition("+params-")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if params == "bf16" else None,
                                      reduce_dtype=torch.float32 if params == "bf16" else None)
        for module in list(model.modules()):
            if type(module).__name__ == "Block":
                fully_shard(module, mp_policy=policy)
        self.ddp = fully_shard(model, mp_policy=policy)  # the module step() runs
        self.compressor = None if grads == "none" else recipes.compression(grads, None, **self.options)
        codes = None
        if params not in ("", "bf16"):
            fmt, _, block = params.partition("/")
            codes = hvd_aps.BlockCodes(fmt, int(block)) if block else hvd_aps.BlockCodes(fmt)
        self.model = model
        if self.compressor is not None or codes is not None:
            hvd_aps.fsdp.apply(model, self.compressor, params=codes)
        return self.task.optimizer(model.parameters(), lr)

    def bytes_per_step(self, n_params):
        """The gradients' payload (as DDPAverager counts it) and what the parameters' codes
        all-gathers sent a step (FSDP's own gathers are not counted)."""
        import hvd_aps.fsdp
        return super().bytes_per_step(n_params) + hvd_aps.fsdp.gather_bytes(self.model) // self.steps


class EmulatedAverager:
    """N workers in one process: per-worker gradients from torch.func.vmap, averaged the way the
    setting's ranks would: codes settings through the codes exchange's own stages (one bucket;
    tensors under min_elements as an exact float32 mean, as the plain allreduce gives), -values
    and fp16 with one rounding and a float32 sum, none as the float32 mean."""

    def __init__(self, setting, task, options, workers):
        self.setting, self.task, self.workers = setting, task, workers
        self.compressors = self.compressor = None
        if setting not in ("none", "fp16") and not setting.endswith("-values"):
            self.compressors = [recipes.compression(setting, None, **options) for _ in range(workers)]
            self.compressor = self.compressors[0]

    def optimizer(self, model, lr):
        return self.task.optimizer(model.parameters(), lr)

    def step(self, model, opt, x, y, loss_scale):
        params = {name: p.detach() for name, p in model.named_parameters()}

        def loss(p, xs, ys):
            return self.task.loss(lambda inputs: torch.func.functional_call(model, p, (inputs,)), xs, ys) * loss_scale

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
            params, x.reshape(self.workers, -1, *x.shape[1:]), y.reshape(self.workers, -1, *y.shape[1:]))
        for p, mean in zip(model.parameters(), self.average([grads[name].numpy() for name in params])):
            p.grad = torch.from_numpy(np.ascontiguousarray(mean, np.float32).reshape(p.shape))
        opt.step()

    def average(self, per_worker):
        """per_worker[t]: tensor t's gradients, (workers, ...) -> each tensor's average."""
        if self.compressors is None:
            if self.setting == "none":
                return [g.mean(axis=0) for g in per_worker]
            kind, fmt = ("naive", "fp16") if self.setting == "fp16" else self.setting.split("-")[:2]
            return [emulate.allreduce(list(g), fmt, scaling="aps" if kind == "aps" else "none") for g in per_worker]
        small = self.compressor.config.min_elements
        coded = [t for t, g in enumerate(per_worker) if g[0].size >= small]
        means = [g.mean(axis=0) for g in per_worker]
        results = emulate.codes_allreduce(self.compressors, [[per_worker[t][w] for t in coded]
                                                             for w in range(self.workers)])
        for t, result in zip(coded, results):
            means[t] = result.copy()
        return means

    def bytes_per_step(self, n_params):
        if self.compressor is None:
            return n_params * (4 if self.setting == "none" else 2)
        small = sum(g for g in self.sizes if g < self.compressor.config.min_elements)
        return self.compressor.totals().bytes_carried // self.steps + 4 * small


def train(averager, task, seed, args, log):
    steps, eval_every = args.steps, args.eval_every
    torch.manual_seed(seed)
    train_set, (x_test, y_test) = task.data()
    x_train, y_train = task.train_eval_set(train_set)
    model = task.model()
    opt = averager.optimizer(model, args.lr / args.loss_scale)
    averager.steps, averager.sizes = steps, [p.numel() for p in model.parameters()]
    gen = torch.Generator().manual_seed(seed)
    curve = {"step": [], "test_accuracy": [], "train_loss": [], "encode_error": [], "flushed": []}
    seen = hvd_aps.TensorStats()
    for step in range(1, steps + 1):
        x, y = task.batch(train_set, gen)  # the same global batch on every rank
        averager.step(model, opt, x, y, args.loss_scale)
        if step % eval_every == 0 or step == steps:
            acc, _ = task.evaluate(model, x_test, y_test)
            _, train_loss = task.evaluate(model, x_train, y_train)
            error, flushed, seen = telemetry(averager.compressor, seen)
            for key, value in zip(curve, (step, acc, train_loss, error, flushed)):
                curve[key].append(value)
            log(f"  {averager.setting:>19} seed {seed} step {step:4d}: test accuracy {acc:.4f} "
                f"train loss {train_loss:.4f} encode error {error:.3f}")
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().ravel()
                        for p in model.parameters()])  # FSDP2: every rank's shards gathered
    return curve, params, averager.bytes_per_step(params.numel())


def telemetry(compressor, seen):
    """Rank 0's relative encode error and fraction flushed since `seen` (the compressor's totals
    at the last call), and the totals now; zeros where no APSCompressor runs."""
    if compressor is None:
        return 0.0, 0.0, seen
    now = compressor.totals()
    norm, nonzero = now.norm_sq - seen.norm_sq, now.nonzero - seen.nonzero
    error = (max(now.error_sq - seen.error_sq, 0.0) / norm) ** 0.5 if norm > 0 else 0.0
    return error, (now.flushed_count - seen.flushed_count) / nonzero if nonzero else 0.0, now


def summarise(runs):
    rows = {}
    fp32 = statistics.mean(r["curve"]["train_loss"][-1] for r in runs["none"]) if "none" in runs else None
    for setting, seeds in runs.items():
        accs = [r["curve"]["test_accuracy"][-1] for r in seeds]
        losses = [r["curve"]["train_loss"][-1] for r in seeds]
        rows[setting] = {"final_test_accuracy_mean": statistics.mean(accs),
                         "final_test_accuracy_std": statistics.pstdev(accs),
                         "final_test_accuracy": accs, "final_train_loss_mean": statistics.mean(losses),
                         "train_loss_over_fp32": statistics.mean(losses) / fp32 if fp32 else None,
                         "final_encode_error_mean": statistics.mean(r["curve"]["encode_error"][-1] for r in seeds),
                         "bytes_per_step_per_worker": seeds[0]["bytes"], "seeds": [r["seed"] for r in seeds]}
    return rows


def write(out, label, rows, runs):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"workers": label, "summary": rows, "runs": runs}, indent=1))
    lines = ["setting,workers,test_accuracy_mean,test_accuracy_std,train_loss_mean,train_loss_over_fp32,"
             "encode_error,bytes_per_step_per_worker"]
    lines += [f"{s},{label},{r['final_test_accuracy_mean']:.4f},{r['final_test_accuracy_std']:.4f},"
              f"{r['final_train_loss_mean']:.4f},{r['train_loss_over_fp32'] or 0:.4f},"
              f"{r['final_encode_error_mean']:.4f},{r['bytes_per_step_per_worker']}" for s, r in rows.items()]
    (out / "results.csv").write_text("\n".join(lines) + "\n")
    plot(out / "curves.png", label, runs)


def plot(path, label, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    styles = ["-", "--", ":", "-."]  # settings that track fp32 overlap: keep each visible
    for i, (setting, seeds) in enumerate(runs.items()):
        steps = seeds[0]["curve"]["step"]
        color = plt.cm.tab20(i % 20)  # more settings than the default cycle has colours
        for ax, key in zip(axes, ("test_accuracy", "train_loss", "encode_error")):
            ax.plot(steps, np.mean([r["curve"][key] for r in seeds], axis=0), styles[i % 4], label=setting,
                    linewidth=1.6, color=color)
    axes[0].set(xlabel="step", ylabel="test accuracy", title=f"{label} workers (mean of seeds)")
    axes[1].set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
    axes[2].set(xlabel="step", ylabel="||q(g) - g|| / ||g||", title="rank 0's encode error")
    axes[2].set_yscale("symlog", linthresh=0.01)  # 8-bit's ~0.03 and 4-bit's ~0.3 both readable
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_study(make_averager, task, settings, seeds, args, log, shown=True):
    """Every setting's runs, one a seed; a progress bar where `shown` (rank 0)."""
    runs = {setting: [] for setting in settings}
    progress = tqdm([(s, seed) for s in settings for seed in seeds], desc=task.name, unit="run", disable=not shown)
    for setting, seed in progress:
        progress.set_postfix_str(f"{setting} seed {seed}")
        start = time.time()
        curve, params, nbytes = train(make_averager(setting), task, seed, args, log)
        runs[setting].append({"seed": seed, "curve": curve, "bytes": nbytes, "params": params,
                              "seconds": time.time() - start})
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="digits")
    parser.add_argument("--quick", action="store_true", help="the quick settings, 2 seeds, a third of the steps (CI size)")
    parser.add_argument("--emulate", help="comma-separated emulated worker counts, e.g. 8,32,256")
    parser.add_argument("--ddp", action="store_true", help="torch.distributed DDP ranks (run under torchrun)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 ranks (run under torchrun)")
    parser.add_argument("--settings", help=f"comma-separated, default all: {','.join(SETTINGS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="default: the task's (digits 400, transformer 300)")
    parser.add_argument("--lr", type=float, help="effective learning rate (after --loss-scale); default: the task's")
    parser.add_argument("--loss-scale", type=float,
                        help="multiplies the loss (the learning rate is divided by it); digits 2**-4, transformer 1")
    parser.add_argument("--hybrid-threshold", type=float,
                        help="the -hybrid settings' threshold (default: APSCompressor's)")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default="results/accuracy")
    args = parser.parse_args()
    task = TASKS[args.task]()
    args.steps, args.lr = args.steps or task.steps, args.lr or task.lr
    args.loss_scale = args.loss_scale or task.loss_scale
    if args.quick:
        args.seeds, args.steps = 2, args.steps * 3 // 8
    settings = args.settings.split(",") if args.settings else (QUICK_SETTINGS[task.name] if args.quick else SETTINGS)
    seeds = list(range(args.seeds))
    out = pathlib.Path(args.out)
    options = {} if args.hybrid_threshold is None else {"hybrid_threshold": args.hybrid_threshold}
    torch.set_num_threads(1)

    if args.emulate:
        for workers in (int(w) for w in args.emulate.split(",")):
            if task.global_batch % workers:
                parser.error(f"{workers} workers do not divide the global batch of {task.global_batch}")
            print(f"{task.name}: {workers} emulated workers", flush=True)
            runs = run_study(lambda s: EmulatedAverager(s, task, options, workers), task, settings, seeds, args, print)
            finish(out / f"{task.name}-emulated-{workers}", f"{task.name} {workers} emulated", runs)
        return

    if args.ddp or args.fsdp:
        return ddp_main(task, settings, seeds, args, options, FSDPAverager if args.fsdp else DDPAverager)
    import horovod.torch as hvd
    hvd.init()
    if hvd.size() < 2 or task.global_batch % hvd.size():
        raise SystemExit(f"run under horovodrun with >= 2 ranks that divide {task.global_batch} "
                         "(with one rank Horovod never compresses)")
    log = print if hvd.rank() == 0 else (lambda *_: None)
    log(f"{task.name}: {hvd.size()} Horovod ranks, settings {settings}, seeds {seeds}, {args.steps} steps")
    runs = run_study(lambda s: HorovodAverager(s, task, options), task, settings, seeds, args, log,
                     shown=hvd.rank() == 0)
    identical = all(bool(hvd.allreduce(r["params"], op=hvd.Max, name=f"id.{s}.{r['seed']}").eq(r["params"]).all())
                    and bool(hvd.allreduce(r["params"], op=hvd.Min, name=f"id2.{s}.{r['seed']}").eq(r["params"]).all())
                    for s, seeds_ in runs.items() for r in seeds_)
    if hvd.rank() == 0:
        finish(out / f"{task.name}-horovod-{hvd.size()}", f"{task.name} {hvd.size()} Horovod", runs,
               {"parameters_identical_on_all_ranks": identical})


def ddp_main(task, settings, seeds, args, options, averager):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if size < 2 or task.global_batch % size:
        raise SystemExit(f"run under torchrun with >= 2 ranks that divide {task.global_batch}")
    settings = [s for s in settings if not s.startswith("codes-") and not s.endswith("-values")]  # Horovod's paths
    log = print if rank == 0 else (lambda *_: None)
    kind = "FSDP2" if averager is FSDPAverager else "DDP"
    if kind == "FSDP2":
        settings = [s for s in settings if s != "fp16"]  # FSDP has no 16-bit hook; a MixedPrecisionPolicy is its own study
    log(f"{task.name}: {size} {kind} ranks, settings {settings}, seeds {seeds}, {args.steps} steps")
    runs = run_study(lambda s: averager(s, task, options), task, settings, seeds, args, log, shown=rank == 0)
    identical = True
    for seeds_ in runs.values():
        for r in seeds_:
            high, low = r["params"].clone(), r["params"].clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            identical = identical and bool(high.eq(r["params"]).all() and low.eq(r["params"]).all())
    if rank == 0:
        finish(pathlib.Path(args.out) / f"{task.name}-{kind.lower()}-{size}", f"{task.name} {size} {kind}", runs,
               {"parameters_identical_on_all_ranks": identical})
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
    print(f"\n{'setting':>19}  test accuracy (mean +- std)  train loss  x fp32  encode error  bytes/step/worker")
    for setting, r in rows.items():
        print(f"{setting:>19}  {r['final_test_accuracy_mean']:.4f} +- {r['final_test_accuracy_std']:.4f}"
              f"{'':12}{r['final_train_loss_mean']:.4f}  {r['train_loss_over_fp32'] or 0:6.4f}"
              f"  {r['final_encode_error_mean']:12.4f}  {r['bytes_per_step_per_worker']:>10}")
    print(f"wrote {out}/results.json, results.csv, curves.png" + (f", checks.json {extra}" if extra else ""))


if __name__ == "__main__":
    main()
