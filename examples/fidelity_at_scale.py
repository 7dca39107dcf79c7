"""Fidelity at scale: the averaged gradient N workers get from the low-precision allreduces a GPU user
would pick instead of hvd_aps (NCCL's FP8/bf16 ring and tree, torch's bf16 DDP hook, FP8 with APS's
shared scale), emulated exactly (hvd_aps.peers), against hvd_aps's codes exchange, for N = 8 .. 1024.

    python examples/fidelity_at_scale.py [--quick] [--out docs/fidelity_at_scale.json] [--summary hvd_aps/fidelity.json]

Real gradients: the accuracy study's byte-level transformer (examples/study_tasks.py, AdamW on the
standard library's source) and a tiny CNN on scikit-learn's 8x8 digits (SGD with momentum, the study's
loss scale 2**-4), each trained in float32 on one process to an early, a middle and a late step. At each
point one global batch of 2048 samples (transformer: random 64-byte windows; digits: drawn with
replacement from the 1437 training images) is cut into N_max contiguous shards and every shard's gradient
taken with torch.func.vmap; N < N_max workers hold the float64 mean of N_max/N consecutive shard
gradients, rounded to float32 (the same gradient; only its float32 rounding differs from taking it
directly).

Per path and N, over every parameter: the relative error ||r - exact|| / ||exact|| of the averaged
gradient against the float64 mean of the workers' float32 gradients; the share of nonzero exact entries
that came back 0; the share saturated (Inf, or |r| at the largest value the path's dtype holds at its
scale where the exact average lies beyond it: clamped, not merely rounded up to it); NaN/Inf entries;
bytes each worker sends a step (a ring or tree: 2(N-1)/N x the dtype's bytes; the scaled paths add their
Max-allreduce; hvd_aps: what worker 0's exchange counts, computed from its layout where N is too large to
run it). Paths:

- NCCL ring e4m3 / e5m2: ncclAvg in FP8, no scale.  + APS scale: one power-of-two scale per tensor from
  a Max-allreduce (hvd_aps.scaling.shift_for, x N headroom), summed in FP8 by the ring, /N in float32.
- NCCL ring bf16 (ncclAvg), torch's bf16_compress_hook (on the ring), NCCL tree bf16 (ncclAvg, 8 ranks a node).
- hvd_aps e4m3 / e5m2 (APS, codes on the wire), hvd_aps e3m0 with error feedback: its first step (no
  residual yet: the same bits as without feedback; feedback pays over steps, which one step does not show).
  Up to 64 workers through emulate.codes_allreduce (one thread per worker: the exchange real ranks run);
  beyond, hvd_aps.peers.aps_allreduce, checked bit for bit against it at every N it ran.

Writes the JSON (--out) and a PNG beside it (relative error against N, log-log, one line per path), and
prints the markdown tables.
"""
import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch

import hvd_aps
from hvd_aps import _layout, emulate, fidelity, peers, scaling
from hvd_aps.peers import Op, Wire

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from study_tasks import DigitsCNN, StdlibText, shard_grads  # noqa: E402

GLOBAL_BATCH = 2048
CODES_UP_TO = 64  # workers emulate.codes_allreduce runs (one thread each); beyond, peers.aps_allreduce


def trained(task, points, seed=0):
    """{step: parameters} of the task's model trained in float32 to each of `points`; the training data."""
    torch.manual_seed(seed)
    train, _ = task.data()
    model = task.model()
    opt = task.optimizer(model.parameters(), task.lr / task.loss_scale)
    gen, kept = torch.Generator().manual_seed(seed), {}
    for step in range(1, max(points) + 1):
        x, y = task.batch(train, gen)
        opt.zero_grad()
        (task.loss(model, x, y) * task.loss_scale).backward()
        opt.step()
        if step in points:
            kept[step] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model, kept, train


def workers_of(finest, n):
    """(n, M) float32: n workers' gradients, each the float64 mean of its consecutive finest shards."""
    return np.concatenate([g.reshape(n, -1, g.shape[1]).mean(axis=1, dtype=np.float64).astype(np.float32)
                           for g in finest], axis=1)


def per_tensor(fn, x, sizes):
    cuts = np.cumsum([0] + sizes)
    return np.concatenate([fn(x[:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])])


def aps_wire_bytes(sizes, n, fmt):
    """Bytes worker 0's codes exchange sends (one chunk): its codes for every other owner's shard
    (alltoall), then its reduced shard, codes and 2-byte block exponents padded to the longest, to
    the N-1 others (allgather)."""
    fmt = hvd_aps.FloatFormat.parse(fmt)
    lay = _layout.Layout(tuple(_layout.Segment(t, 0, k) for t, k in enumerate(sizes)), n)
    shards = list(zip(lay.shards[:-1].tolist(), lay.shards[1:].tolist()))
    reduced = max(fmt.packed_size(hi - lo) + 2 * lay.blocks_in(lo, hi) for lo, hi in shards)
    return sum(fmt.packed_size(hi - lo) for lo, hi in shards[1:]) + (n - 1) * reduced


def hvd_aps_path(fmt, feedback, x, sizes, checks):
    """hvd_aps's result and worker 0's bytes: the codes exchange (n <= CODES_UP_TO, and the model
    checked against it) or the model alone."""
    n = len(x)
    model = per_tensor(lambda part: peers.aps_allreduce(part, fmt), x, sizes)
    if n > CODES_UP_TO:
        return model, aps_wire_bytes(sizes, n, fmt)
    cuts = np.cumsum([0] + sizes)
    compressors = [hvd_aps.APSCompressor(fmt, error_feedback=feedback, stats=False) for _ in range(n)]
    grads = [[row[a:b] for a, b in zip(cuts[:-1], cuts[1:])] for row in x]
    result = np.concatenate(emulate.codes_allreduce(compressors, grads))
    sent = compressors[0].bytes_sent
    for c in compressors:
        c.close()
    checks.append({"format": fmt, "error_feedback": feedback, "workers": n,
                   "model_bits_equal_codes_allreduce": result.tobytes() == model.tobytes(),
                   "bytes_sent": sent, "bytes_from_layout": aps_wire_bytes(sizes, n, fmt)})
    return result, sent


def nccl(fn, wire):
    """A peer that runs on the whole flat gradient (one DDP bucket): (result, the largest |result|
    the dtype holds, bytes)."""
    def path(x, sizes, checks):
        n, m = x.shape
        return fn(x, wire), wire.max, 2 * (n - 1) / n * m * wire.dtype.itemsize
    return path


def scaled(wire):
    """FP8 with APS's per-tensor scale: its largest |result| is max at that tensor's scale."""
    def path(x, sizes, checks):
        n, m = x.shape
        result = per_tensor(lambda part: peers.scaled_fp8_allreduce(part, wire), x, sizes)
        limit = per_tensor(lambda part: np.full(part.shape[1], np.ldexp(wire.max, -scaling.shift_for(
            float(np.abs(part).max()), n, wire.fmt)) / n, np.float32), x, sizes)
        return result, limit, 2 * (n - 1) / n * (m + 4 * len(sizes))
    return path


def ours(fmt, feedback):
    """hvd_aps: nothing clamps (APS bounds every term and every re-encoded block)."""
    def path(x, sizes, checks):
        result, sent = hvd_aps_path(fmt, feedback, x, sizes, checks)
        return result, np.inf, sent
    return path


PATHS = {
    "NCCL ring e4m3": nccl(lambda x, w: peers.nccl_ring_allreduce(x, w, Op.AVG), Wire.FLOAT8_E4M3),
    "NCCL ring e5m2": nccl(lambda x, w: peers.nccl_ring_allreduce(x, w, Op.AVG), Wire.FLOAT8_E5M2),
    "NCCL ring e4m3 + APS scale": scaled(Wire.FLOAT8_E4M3),
    "NCCL ring e5m2 + APS scale": scaled(Wire.FLOAT8_E5M2),
    "NCCL ring bf16": nccl(lambda x, w: peers.nccl_ring_allreduce(x, w, Op.AVG), Wire.BFLOAT16),
    "torch bf16 hook": nccl(peers.torch_hook_allreduce, Wire.BFLOAT16),
    "NCCL tree bf16": nccl(lambda x, w: peers.nccl_tree_allreduce(x, w, Op.AVG, ranks_per_node=8), Wire.BFLOAT16),
    "hvd_aps e4m3": ours("e4m3", False),
    "hvd_aps e5m2": ours("e5m2", False),
    "hvd_aps e3m0 + EF (1 step)": ours("e3m0", True),
}


def measure(x, sizes, checks):
    exact = x.mean(axis=0, dtype=np.float64)
    rows = []
    for name, path in PATHS.items():
        began = time.perf_counter()
        result, limit, sent = path(x, sizes, checks)
        nonzero = exact != 0
        saturated = np.isinf(result) | ((np.abs(result) >= limit) & (np.abs(exact) > limit))  # clamped
        rows.append({"path": name, "workers": len(x),
                     "relative_error": float(np.linalg.norm(result - exact) / np.linalg.norm(exact)),
                     "flushed": float(np.mean(result[nonzero] == 0)), "saturated": float(np.mean(saturated)),
                     "nan_inf": int(np.sum(~np.isfinite(result))), "bytes_per_worker": int(round(sent)),
                     "seconds": round(time.perf_counter() - began, 2)})
    return rows


def _table(heading, rows, ns, cell):
    """A markdown table: one row per path, one column per N, cell(record) in each."""
    at = {(r["path"], r["workers"]): r for r in rows}
    lines = [f"\n{heading}\n", "| path | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
    for path in dict.fromkeys(r["path"] for r in rows):
        lines.append(f"| {path} | " + " | ".join(cell(at[path, n]) for n in ns) + " |")
    return lines


def tables(records, ns):
    """Per task and point: relative error (flushed share) per path and N, and anything saturated or
    not finite; per task: bytes per worker (the same at every point)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in records):
        mine = [r for r in records if r["task"] == task]
        for step in dict.fromkeys(r["step"] for r in mine):
            rows = [r for r in mine if r["step"] == step]
            out += _table(f"**{task}, step {step}** ({rows[0]['elements']} gradient entries): relative error "
                          "(share of nonzero entries flushed to 0)", rows, ns,
                          lambda r: f"{r['relative_error']:.2e} ({100 * r['flushed']:.1f}%)")
            odd = [f"{r['path']} N={r['workers']}: saturated {100 * r['saturated']:.3f}%, NaN/Inf {r['nan_inf']}"
                   for r in rows if r["saturated"] or r["nan_inf"]]
            out.append("\nSaturated or NaN/Inf: " + ("; ".join(odd) if odd else "none"))
        out += _table(f"**{task}: KiB each worker sends a step**", [r for r in mine if r["step"] == mine[0]["step"]],
                      ns, lambda r: f"{r['bytes_per_worker'] / 1024:.1f}")
    return "\n".join(out)


def plot(path, records, ns):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    panels = list(dict.fromkeys((r["task"], r["step"]) for r in records))
    tasks = list(dict.fromkeys(t for t, _ in panels))
    cols = max(sum(t == task for t, _ in panels) for task in tasks)
    fig, axes = plt.subplots(len(tasks), cols, figsize=(5.2 * cols, 4.2 * len(tasks)), squeeze=False)
    styles = {"NCCL": "--", "torch": ":", "hvd_aps": "-"}
    for (task, step), ax in zip(panels, [a for row in axes for a in row]):
        for i, name in enumerate(PATHS):
            ys = [r["relative_error"] for n in ns for r in records
                  if (r["task"], r["step"], r["path"], r["workers"]) == (task, step, name, n)]
            ax.plot(ns, ys, styles[name.split()[0]], marker="o", color=plt.cm.tab10(i), label=name, linewidth=1.6)
        ax.set(xscale="log", yscale="log", xlabel="workers N", ylabel="relative error of the average",
               title=f"{task}, step {step}")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N in 8, 64; one (early) point per task")
    parser.add_argument("--out", default="docs/fidelity_at_scale.json", help="the JSON; the PNG goes beside it")
    parser.add_argument("--summary", help="also write the errors `python -m hvd_aps plan` prints "
                                          "(hvd_aps.fidelity; the package's: hvd_aps/fidelity.json)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    ns = [8, 64] if args.quick else [8, 64, 256, 1024]
    records, checks, began = [], [], time.perf_counter()
    for task in (StdlibText(), DigitsCNN()):
        points = [5] if args.quick else [5, task.steps // 2, task.steps]
        model, kept, train = trained(task, points)
        batch, task.global_batch = task.global_batch, GLOBAL_BATCH
        x, y = task.batch(train, torch.Generator().manual_seed(1))
        task.global_batch = batch
        for step in points:
            finest = shard_grads(task, model, kept[step], x, y, max(ns))
            sizes = [g.shape[1] for g in finest]
            for n in ns:
                for row in measure(workers_of(finest, n), sizes, checks):
                    records.append({"task": task.name, "step": step, "elements": sum(sizes), **row})
                print(f"  {task.name} step {step} N={n}: done at {time.perf_counter() - began:.0f} s", file=sys.stderr)
    assert all(c["model_bits_equal_codes_allreduce"] for c in checks), checks
    text = tables(records, ns)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workers": ns, "global_batch": GLOBAL_BATCH, "quick": args.quick,
                               "seconds": round(time.perf_counter() - began, 1), "records": records,
                               "codes_allreduce_checks": checks, "markdown": text}, indent=1))
    plot(out.with_suffix(".png"), records, ns)
    if args.summary:
        pathlib.Path(args.summary).write_text(json.dumps(fidelity.summary(records), indent=1) + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - began:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
