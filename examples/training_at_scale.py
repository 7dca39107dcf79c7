"""Training at scale, emulated: N = 64 and 256 workers in one process, every step each worker's
gradient on its own shard of the global batch, reduced by the low-precision allreduce a GPU user
would pick (hvd_aps.peers: NCCL's ring and tree, FP8 with and without APS's shared scale) or by
hvd_aps's codes exchange, and the optimizer stepping on what the path returns. Each path trains its
own trajectory from the same initial weights and the same batches.

    python examples/training_at_scale.py [--quick] [--jobs 2] [--out docs/training_at_scale.json]

Tasks (examples/study_tasks.py): the accuracy study's byte-level transformer narrowed to width 32
and 32-byte windows (2 layers, 4 heads, 43,136 parameters; AdamW, lr 3e-3) on the standard
library's source, and the digits CNN of examples/fidelity_at_scale.py (TinyCNN, 38,282 parameters;
SGD with momentum, lr 0.05, the study's loss scale 2**-4) on scikit-learn's 8x8 digits. Global
batch 256 samples (transformer: 256 random 32-byte windows) at every N: at N = 256 each worker
holds one sample, at N = 64 four (contiguous shards of the batch). Per-worker gradients:
torch.func.vmap over the shards (study_tasks.shard_grads), float32, one torch thread. Budget
(FULL): the transformer 60 steps, the digits CNN 80, loss evaluated every 4; N = 64 and 256,
seeds 0 and 1, every path: 72 trajectories, --jobs of them at once, one process each (3,870
process-seconds, 33 minutes with --jobs 2 at nice 19 on 2 shared cores; N = 256's transformer is
two thirds of it). --quick: N = 64, seed 0, 10 steps a task, evaluated every 2 (about 100 s).

Paths, each on the flat gradient of all tensors (one DDP bucket) or per tensor where the method is
per tensor:
- fp32: the exact mean of the workers' float32 gradients (float64, rounded to float32): the reference.
- NCCL ring bf16, NCCL tree bf16 (8 ranks a node), NCCL ring e4m3, NCCL ring e5m2: ncclAvg in that
  dtype, hvd_aps.peers.nccl_ring_allreduce / nccl_tree_allreduce (every cast and add as NCCL does).
- NCCL ring e4m3 + APS scale: per tensor, the shared power-of-two scale from a Max-allreduce, FP8 ring
  sum, /N in float32 (peers.scaled_fp8_allreduce).
- hvd_aps e4m3, hvd_aps e5m2: per tensor, the codes exchange with APS (peers.aps_allreduce: bit for
  bit emulate.codes_allreduce's result, without a thread per worker).
- hvd_aps e3m0 + EF: the codes exchange with error feedback (ErrorFeedback below), which needs state
  across steps: every worker keeps its send residual (what its codes lost last step) and adds it
  before encoding; the owner of every element keeps what its re-encode of the sum lost and adds it to
  the next sum. It is written with hvd_aps's own codec functions (codec.encode/decode/decode_sum/
  quantize, scaling.shift_for/shifts_for) in the exchange's order of operations; it models the
  exchange's arithmetic, not its wire (no bytes move, no threads, no layout: residuals are kept as
  one (N, elements) array and one owner array, which is where the exchange keeps them element for
  element while N and the layout stay fixed). Where N <= --codes-up-to (64) the first --check-steps
  steps of every hvd_aps trajectory (EF or not) also run the real exchange,
  hvd_aps.emulate.codes_allreduce (one APSCompressor and thread per worker, the driver real ranks
  run, residuals in its own state), on the same gradients, and the model's result must equal it bit
  for bit (the script fails otherwise); tests/test_training_at_scale.py checks the same at small N
  over several steps. At N = 256 the trajectories are the model's alone.
  Every tensor goes through the path, the small ones too (biases, LayerNorm): hvd_aps's framework
  entry points would send tensors under min_elements (4096) by a plain float32 allreduce instead.

Loss: the mean cross-entropy on a fixed training set (transformer: 256 fixed 32-byte windows of the
training text, study_tasks.train_eval_set; digits: all 1437 training images), evaluated every
`eval_every` steps and at the end. Target, fixed in advance: fp32's loss at TARGET_FRACTION (80 %)
of the step budget, for the same task, N and seed; steps to target: the first evaluated step whose
loss is at or below it ("never" within the budget otherwise; fp32 reaches it by 80 % by
construction, earlier if its curve dips below first). Final loss: at the last step; relative: over
fp32's final loss for the same task, N and seed.

Writes the JSON (--out), a PNG of the loss curves beside it (a panel per task and N, a line per
path, the mean over seeds), and prints the markdown tables.
"""
import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch

import hvd_aps
from hvd_aps import codec, emulate, peers, scaling
from hvd_aps._layout import BLOCK
from hvd_aps.formats import FloatFormat
from hvd_aps.peers import Op, Wire

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from study_tasks import ByteTransformer, DigitsCNN, StdlibText, shard_grads  # noqa: E402

TARGET_FRACTION = 0.8   # the target: fp32's loss at this share of the step budget (fixed before any run)
GLOBAL_BATCH = 256      # samples a step over all workers, at every N
JOB_S = 3600            # the longest wait for a job's record (the dearest took 463 s on 2 shared cores)
FLOAT32_MAX = float(np.finfo(np.float32).max)


class NarrowText(StdlibText):
    """The study's byte transformer at width 32 on 32-byte windows: a step's per-worker gradients
    at N = 256 cost about a quarter of the width-64, 64-byte model's, which lets the 72
    trajectories fit within an hour on 2 shared cores."""
    CONTEXT = 32
    WIDTH = 32

    def __init__(self):
        super().__init__()
        self.name = "transformer-w32"

    def model(self):
        return ByteTransformer(width=self.WIDTH, context=self.CONTEXT)


TASKS = {"transformer-w32": NarrowText, "digits-cnn": DigitsCNN}
# step budget, evaluation interval (it divides TARGET_FRACTION of the steps)
FULL = {"transformer-w32": (60, 4), "digits-cnn": (80, 4)}
QUICK = {"transformer-w32": (10, 2), "digits-cnn": (10, 2)}


def tensors(sizes):
    cuts = np.cumsum([0] + list(sizes))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def per_tensor(fn, x, sizes):
    return np.concatenate([fn(x[:, a:b]) for a, b in tensors(sizes)])


class ErrorFeedback:
    """hvd_aps's codes exchange with error feedback (config error_feedback=True, nearest rounding,
    APS), one step a call, as arithmetic: per tensor, each worker's gradient plus its send residual;
    the APS shift from the Max-allreduced max |.| of those over all workers (x N headroom against
    float32's max, the codes path's sum); codes at that shift; the worker's new send residual: what
    it sent less what its codes say; the sum of the decoded codes in rank order in float32 from +0.0
    (the owner's table_sum); plus the owner residual; every BLOCK elements of it re-encoded at the
    shift of the block's own max (x 1 headroom); the new owner residual: the sum less its re-encode;
    the result: the re-encode / N. A tensor whose max is not finite comes back NaN and restarts its
    send residuals from zero (the exchange's fallback). Bit for bit emulate.codes_allreduce with
    APSCompressor(fmt, error_feedback=True), step after step (tests/test_training_at_scale.py)."""

    def __init__(self, fmt, workers, sizes):
        self.fmt, self.sizes = FloatFormat.parse(fmt), list(sizes)
        self.send = np.zeros((workers, sum(self.sizes)), np.float32)
        self.owner = np.zeros(sum(self.sizes), np.float32)

    def __call__(self, x):
        n, fmt = len(x), self.fmt
        corrected = (np.asarray(x, np.float32) + self.send).astype(np.float32)
        out = np.empty(corrected.shape[1], np.float32)
        for a, b in tensors(self.sizes):
            c = corrected[:, a:b]
            peak = codec.amax(c)
            if not np.isfinite(peak):
                out[a:b], self.send[:, a:b] = np.nan, 0
                continue
            shift = scaling.shift_for(peak, n, fmt, FLOAT32_MAX)
            codes = codec.encode(c, fmt, shift=shift)
            self.send[:, a:b] = c - codec.decode(codes, fmt, shift=shift)
            total = codec.decode_sum(codes, fmt, shift=shift) + self.owner[a:b]
            each = np.repeat(scaling.shifts_for(codec.amax_blocks(total, BLOCK), 1, fmt).astype(np.int32),
                             BLOCK)[:b - a]
            kept = np.ldexp(codec.quantize(np.ldexp(total, each), fmt), -each).astype(np.float32)
            self.owner[a:b] = total - kept
            out[a:b] = kept / np.float32(n)
        return out


def exact_mean(x):
    return x.mean(axis=0, dtype=np.float64).astype(np.float32)


def _ring(wire):
    return lambda n, sizes: lambda x: peers.nccl_ring_allreduce(x, wire, Op.AVG)


def _aps(fmt):
    return lambda n, sizes: lambda x: per_tensor(lambda part: peers.aps_allreduce(part, fmt), x, sizes)


# name -> (fmt and error feedback of the codes exchange it is, or None; factory(N, sizes) -> reduce(x))
PATHS = {
    "fp32": (None, lambda n, sizes: exact_mean),
    "NCCL ring bf16": (None, _ring(Wire.BFLOAT16)),
    "NCCL tree bf16": (None, lambda n, sizes: lambda x: peers.nccl_tree_allreduce(x, Wire.BFLOAT16, Op.AVG, 8)),
    "NCCL ring e4m3": (None, _ring(Wire.FLOAT8_E4M3)),
    "NCCL ring e4m3 + APS scale": (None, lambda n, sizes: lambda x: per_tensor(
        lambda part: peers.scaled_fp8_allreduce(part, Wire.FLOAT8_E4M3), x, sizes)),
    "NCCL ring e5m2": (None, _ring(Wire.FLOAT8_E5M2)),
    "hvd_aps e4m3": (("e4m3", False), _aps("e4m3")),
    "hvd_aps e5m2": (("e5m2", False), _aps("e5m2")),
    "hvd_aps e3m0 + EF": (("e3m0", True), lambda n, sizes: ErrorFeedback("e3m0", n, sizes)),
}


class RealExchange:
    """emulate.codes_allreduce over all tensors as one bucket, one APSCompressor per worker kept
    across steps: the exchange real ranks run."""

    def __init__(self, fmt, feedback, workers):
        self.compressors = [hvd_aps.APSCompressor(fmt, error_feedback=feedback, stats=False) for _ in range(workers)]

    def __call__(self, x, sizes):
        grads = [[row[a:b] for a, b in tensors(sizes)] for row in x]
        return np.concatenate(emulate.codes_allreduce(self.compressors, grads))

    def close(self):
        for c in self.compressors:
            c.close()


def train(task, data, workers, seed, path, steps, eval_every, check_steps=0, global_batch=None):
    """One trajectory of `path` at `workers` workers from seed `seed` (its initial weights and its
    batches): the record (loss curve, the first check_steps steps' bit checks against the real
    exchange for an hvd_aps path) and the final parameters."""
    global_batch = global_batch or GLOBAL_BATCH
    train_set, (x_eval, y_eval) = data
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(model.parameters(), task.lr / task.loss_scale)
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    exchange, make = PATHS[path]
    reduce = make(workers, sizes)
    real = RealExchange(*exchange, workers) if exchange and check_steps else None
    gen = torch.Generator().manual_seed(seed)
    batch, task.global_batch = task.global_batch, global_batch
    curve, checked, began = [[0, task.evaluate(model, x_eval, y_eval)[1]]], [], time.perf_counter()
    try:
        for step in range(1, steps + 1):
            x, y = task.batch(train_set, gen)
            params = {name: p.detach() for name, p in model.named_parameters()}
            grads = np.concatenate(shard_grads(task, model, params, x, y, workers, samples_at_once=global_batch),
                                   axis=1)
            result = reduce(grads)
            if real is not None and step <= check_steps:
                checked.append(result.tobytes() == real(grads, sizes).tobytes())
            for p, (a, b), shape in zip(model.parameters(), tensors(sizes), shapes):
                p.grad = torch.from_numpy(result[a:b].reshape(shape).copy())
            opt.step()
            if step % eval_every == 0 or step == steps:
                curve.append([step, task.evaluate(model, x_eval, y_eval)[1]])
    finally:
        task.global_batch = batch
        if real is not None:
            real.close()
    record = {"task": task.name, "workers": workers, "seed": seed, "path": path, "global_batch": global_batch,
              "steps": steps,
              "eval_every": eval_every, "curve": curve, "final_loss": curve[-1][1],
              "finite": bool(np.isfinite(curve[-1][1])), "seconds": round(time.perf_counter() - began, 1)}
    if real is not None:
        record["real_exchange_steps_checked"] = len(checked)
        record["real_exchange_bits_equal"] = all(checked)
    return record, [p.detach().clone() for p in model.parameters()]


def scored(records):
    """Each record given its target (fp32's loss at TARGET_FRACTION of the steps, same task, N and
    seed), its steps to the target (None: never within the budget) and its final loss over fp32's."""
    fp32 = {(r["task"], r["workers"], r["seed"]): r for r in records if r["path"] == "fp32"}
    for r in records:
        ref = fp32[r["task"], r["workers"], r["seed"]]
        at = round(TARGET_FRACTION * ref["steps"])
        target = dict(map(tuple, ref["curve"]))[at]
        r["target"], r["target_step"] = target, at
        r["steps_to_target"] = next((s for s, loss in r["curve"] if s > 0 and loss <= target), None)
        r["final_vs_fp32"] = r["final_loss"] / ref["final_loss"]
    return records


def tables(records):
    """One table per task: a row per path, a column per (N, seed); each cell 'steps to target;
    final loss (final / fp32's)'."""
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        mine = [r for r in records if r["task"] == task]
        cols = list(dict.fromkeys((r["workers"], r["seed"]) for r in mine))
        at = {(r["path"], r["workers"], r["seed"]): r for r in mine}
        ref = [at["fp32", n, s] for n, s in cols]
        lines += [f"\n**{task}**, {ref[0]['steps']} steps, global batch {ref[0]['global_batch']}: steps to the target; "
                  "final loss (final / fp32's final). Target: fp32's loss at step "
                  f"{ref[0]['target_step']} (" + ", ".join(f"N={n} seed {s}: {r['target']:.4f}"
                                                           for (n, s), r in zip(cols, ref)) + ")\n",
                  "| path | " + " | ".join(f"N={n}, seed {s}" for n, s in cols) + " |", "|---|" + "---:|" * len(cols)]
        for path in dict.fromkeys(r["path"] for r in mine):
            cells = []
            for n, s in cols:
                r = at.get((path, n, s))
                cells.append("" if r is None else
                             f"{r['steps_to_target'] if r['steps_to_target'] else 'never'}; "
                             f"{r['final_loss']:.4f} ({r['final_vs_fp32']:.3f})")
            lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path, records):
    """A panel per task (rows) and N (columns): the training-set loss against the step, a line per
    path (the mean over seeds), and the target (fp32's at 80 %, the mean over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(dict.fromkeys(r["task"] for r in records))
    ns = list(dict.fromkeys(r["workers"] for r in records))
    fig, axes = plt.subplots(len(tasks), len(ns), figsize=(5.6 * len(ns), 4.4 * len(tasks)), squeeze=False)
    colors = dict(zip(PATHS, ["black", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                              "tab:blue", "tab:cyan", "tab:olive"]))
    for row, task in zip(axes, tasks):
        for ax, n in zip(row, ns):
            for name in PATHS:
                runs = [r for r in records if (r["task"], r["workers"], r["path"]) == (task, n, name)]
                if not runs:
                    continue
                steps = [s for s, _ in runs[0]["curve"]]
                loss = np.mean([[v for _, v in r["curve"]] for r in runs], axis=0)
                ax.plot(steps, loss, "--" if name.startswith("NCCL") else "-", color=colors[name], label=name,
                        linewidth=2.4 if name == "fp32" else 1.4)
            targets = [r["target"] for r in records if (r["task"], r["workers"], r["path"]) == (task, n, "fp32")]
            ax.axhline(np.mean(targets), color="gray", linewidth=0.8, linestyle=":",
                       label=f"target (fp32 at {TARGET_FRACTION:.0%})")
            ax.set(xlabel="step", ylabel="training-set loss",
                   title=f"{task}, N={n} (mean of {len(targets)} seed{'s' * (len(targets) > 1)})")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_DATA = {}  # per process: each task's (task, (training set, evaluation set)), loaded once


def _data(name):
    if name not in _DATA:
        task = TASKS[name]()
        train_set, _ = task.data()
        _DATA[name] = task, (train_set, task.train_eval_set(train_set))
    return _DATA[name]


def _job(job):
    """One trajectory in a worker process (one torch thread: per-sample gradients of models this
    small run faster on one thread than on two)."""
    torch.set_num_threads(1)
    name, n, seed, path, steps, eval_every, check_steps, global_batch = job
    task, data = _data(name)
    return train(task, data, n, seed, path, steps, eval_every, check_steps, global_batch)[0]


def run(task_names, ns, seeds, paths, budget, check_steps, codes_up_to, jobs=1, log=None, global_batch=None):
    """Every (task, N, seed, path) trajectory, `jobs` at a time in as many processes (1: in this
    one); the records, in that order, scored."""
    for name in task_names:
        steps, eval_every = budget[name]
        if round(TARGET_FRACTION * steps) % eval_every:
            raise ValueError(f"{name}: the target's step {round(TARGET_FRACTION * steps)} is not evaluated")
    todo = [(name, n, seed, path, *budget[name], check_steps if n <= codes_up_to else 0, global_batch)
            for name in task_names for n in ns for seed in seeds for path in paths]
    records = {}
    if jobs == 1:
        done = map(_job, todo)
    else:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(jobs)
        # the dearest first (N = 256, the transformer), so the last jobs left are short
        order = sorted(todo, key=lambda j: (-j[1], j[0] != "transformer-w32"))
        done = pool.imap_unordered(_job, order)
    try:
        for _ in todo:
            record = next(done) if jobs == 1 else done.next(timeout=JOB_S)
            records[record["task"], record["workers"], record["seed"], record["path"]] = record
            if log:
                log(f"  {record['task']} N={record['workers']} seed {record['seed']} {record['path']}: "
                    f"final loss {record['final_loss']:.4f} in {record['seconds']:.1f} s ({len(records)}/{len(todo)})")
    finally:
        if jobs != 1:
            pool.terminate()  # every record is in, or one was not within JOB_S: nothing left to wait for
            pool.join()  # bounded: terminate() stopped its workers
    return scored([records[job[:4]] for job in todo])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N=64 only, one seed, 10 steps a task")
    parser.add_argument("--out", default="docs/training_at_scale.json", help="the JSON; the PNG goes beside it")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1; --quick 0)")
    parser.add_argument("--check-steps", type=int, default=None,
                        help="steps of every hvd_aps trajectory at N <= --codes-up-to also run through "
                             "emulate.codes_allreduce and compared bit for bit (default 3; --quick 2)")
    parser.add_argument("--codes-up-to", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=2, help="trajectories run at once, one process each")
    parser.add_argument("--replot", action="store_true", help="train nothing: the tables and the PNG from --out")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.replot:
        records = json.loads(out.read_text())["records"]
        print(tables(records))
        plot(out.with_suffix(".png"), records)
        return
    torch.set_num_threads(1)
    ns = [64] if args.quick else [64, 256]
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    budget = QUICK if args.quick else FULL
    check_steps = args.check_steps if args.check_steps is not None else (2 if args.quick else 3)
    began = time.perf_counter()

    def log(line):
        print(f"{line} [{time.perf_counter() - began:.0f} s]", file=sys.stderr, flush=True)

    records = run(list(TASKS), ns, seeds, list(PATHS), budget, check_steps, args.codes_up_to, args.jobs, log)
    checks = [{k: r[k] for k in ("task", "workers", "seed", "path", "real_exchange_steps_checked",
                                 "real_exchange_bits_equal")} for r in records if "real_exchange_bits_equal" in r]
    text = tables(records)
    print(text)
    print("\nReal exchange (emulate.codes_allreduce) against the trajectories' hvd_aps results: "
          + ", ".join(f"{c['task']} N={c['workers']} seed {c['seed']} {c['path']}: {c['real_exchange_steps_checked']} "
                      f"steps {'bit-equal' if c['real_exchange_bits_equal'] else 'DIFFERENT'}" for c in checks))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"quick": args.quick, "jobs": args.jobs, "torch_threads": 1, "workers": ns,
                               "seeds": seeds, "global_batch": GLOBAL_BATCH,
                               "budget": {k: {"steps": s, "eval_every": e} for k, (s, e) in budget.items()},
                               "target": f"fp32's training-set loss at {TARGET_FRACTION:.0%} of the steps, "
                                         "same task, N and seed",
                               "seconds": round(time.perf_counter() - began, 1), "records": records,
                               "real_exchange_checks": checks, "markdown": text}, indent=1))
    plot(out.with_suffix(".png"), records)
    log(f"wrote {out} and {out.with_suffix('.png')}")
    assert all(c["real_exchange_bits_equal"] for c in checks), checks


if __name__ == "__main__":
    main()
