"""`python -m hvd_aps plan` against steps the netns cluster measured, nothing fitted: every figure
the prediction uses comes from `calibrate` as a user runs it (the codec and the copy rate in one
process; the link, each entry point's costs and the contention inside a job on the same
cluster), and from the row itself only its compute (forward, backward and optimizer, which the
benchmark measured without communication).

    sudo .venv/bin/python -m hvd_aps calibrate --format e4m3 --out cal.json
    sudo .venv/bin/python examples/netns_cluster.py --hosts 2 --rates 1gbit,none --calibrate cal.json
    sudo .venv/bin/python examples/netns_cluster.py --hosts 2 --rates 1gbit,none ... --json rows.json
    .venv/bin/python examples/plan_check.py --calibration cal.json --rows rows.json:400 [--rows ...]
    .venv/bin/python examples/plan_check.py --calibration cal.json --calibration cal2.json --rates 1gbit ...

--calibration, repeated: the settings predicted with each, side by side (how far the calibration
moves them from one run of it to the next); --rates: only the settings at those rates. Each
prediction comes with the range plan states (hvd_aps.calibration.draws: the calibration fitted again
from its own repeats drawn again), and the summary says how many measured steps fall inside it.

--rows FILE[:TENSORS]: netns_cluster's rows; TENSORS the gradient tensors of a `tensors` profile
(its rows name the parameters, not how many tensors hold them); a setting found in several files
is measured by the median of all their invocations. Each setting is predicted with the
calibration of its cluster's shape, rate and framework (cal.HxL.RATE.FRAMEWORK.json, as
netns_cluster --calibrate names them), its entry point's paths as plan builds them
(Calibration.paths), its gradients ready as the profile's timeline says (docs/perf_model_timelines.json; a `tensors` profile's in
proportion to their elements) and every rank sharing this machine's cores.
"""
import argparse
import json
import pathlib
import statistics

from hvd_aps import calibration, perf

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
RESNET18 = "resnet18/11689512"  # the profile timelines' key of ResNet-18 (its timeline, not its image size)
ENTRIES = {"": perf.EntryPoint.HOROVOD, "ddp": perf.EntryPoint.DDP}
PATHS = {"none": perf.FLOAT32_PATH, "fp16": perf.HALF_PATH}
CODES_PREFIX = "codes-"  # hvd_aps.torch.DistributedOptimizer (examples/recipes.py)


def entry_and_path(compression: str) -> tuple:
    """(entry point, plan's path name, format or None) of a netns_cluster compression name."""
    framework, _, name = compression.rpartition(":")
    if name in PATHS:
        return ENTRIES[framework], PATHS[name], None
    fmt = name.split("-", 1)[1]
    entry = perf.EntryPoint.CODES if name.startswith(CODES_PREFIX) else ENTRIES[framework]
    return entry, perf.codes_path(fmt), fmt


def workload(row: dict, entry: perf.EntryPoint, tensors: "int | None", timelines: dict) -> perf.Workload:
    """The row's step for the model: its own compute, `entry`'s buckets, its gradients' timeline."""
    compute = row["forward"] + row["backward"]
    timeline = timelines.get(f"{row['profile']}/{row['params']}") if row["profile"] != "tensors" else None
    return perf.Workload(row["params"], compute, row["backward"] / compute, row["optimizer"],
                         perf.entry_buckets(row["params"], entry), None if timeline else tensors,
                         [tuple(g) for g in timeline] if timeline else None)


def predict(row: dict, tensors: "int | None", base: pathlib.Path, timelines: dict) -> tuple:
    """(the predicted step, its range: (low, high) over the calibration's draws, None without)."""
    entry, name, fmt = entry_and_path(row["compression"])
    framework = "torch" if entry is perf.EntryPoint.DDP else "horovod"
    shape = f"{row['hosts']}x{row['ranks_per_host']}.{row['rate']}.{framework}"
    loaded = calibration.load(base.with_name(f"{base.stem}.{shape}.json"))
    world, work = row["hosts"] * row["ranks_per_host"], workload(row, entry, tensors, timelines)

    def step(cal):
        path = next(p for p in cal.paths(entry, [fmt] if fmt else []) if p.name == name)
        cluster = perf.Cluster(row["hosts"], cal.link, row["ranks_per_host"], sharing=world, copy=cal.copy or 0.0,
                               **cal.contentions())
        return perf.step_time(work, path, cluster)
    drawn = calibration.draws(loaded)
    return step(loaded), calibration.spread([step(d) for d in drawn]) if drawn else None


def settings(specs: list) -> list:
    """The rows of every FILE[:TENSORS] grouped by setting (profile, size, tensors, cluster,
    compression): each setting's last row, its tensors, and every invocation's step
    (netns_cluster's `step_runs`) from all the files."""
    grouped = {}
    for spec in specs:
        file, _, tensors = spec.partition(":")
        for row in json.loads(pathlib.Path(file).read_text()):
            key = (row["profile"], row["params"], tensors, row["hosts"], row["ranks_per_host"], row["rate"],
                   row["compression"])
            _, _, runs = grouped.get(key, (None, None, []))
            grouped[key] = row, int(tensors) if tensors else None, runs + row.get("step_runs", [row["step_median"]])
    return list(grouped.values())


def check(rows: list, calibration: pathlib.Path, timelines: dict) -> list:
    """Every setting of `rows` (settings()) measured and predicted with `calibration`."""
    out = []
    for row, tensors, runs in rows:
        measured = statistics.median(runs)
        predicted, span = predict(row, tensors, calibration, timelines)
        out.append({k: row[k] for k in ("profile", "params", "hosts", "ranks_per_host", "rate", "compression")}
                   | {"tensors": tensors, "runs": runs, "measured": measured, "predicted": predicted,
                      "error": predicted / measured - 1, "range": span,
                      "covered": None if span is None else span[0] <= measured <= span[1]})
    return out


def _span_text(span) -> str:
    return "-" if span is None else f"{1e3 * span[0]:.1f}-{1e3 * span[1]:.1f}"


def report(checks: list) -> None:
    """The settings' table, an error column a calibration (and their range where several), then
    each calibration's summary."""
    several = len(checks) > 1
    ranged = not several and any(o["range"] is not None for o in checks[0])
    print(f"{'profile':>9} {'tensors':>7} {'rate':>8} {'compression':>14} {'runs':>4} {'meas ms':>8} {'spread':>6} "
          + ("" if several else f"{'pred ms':>8} ") + (f"{'pred range':>13} " if ranged else "")
          + " ".join(f"{'error':>6}" for _ in checks)
          + (f" {'range':>6}" if several else ""))
    for predictions in zip(*checks):
        o, errors = predictions[0], [p["error"] for p in predictions]
        spread = (max(o["runs"]) - min(o["runs"])) / o["measured"]
        print(f"{o['profile']:>9} {o['tensors'] or '':>7} {o['rate']:>8} {o['compression']:>14} {len(o['runs']):>4} "
              f"{1e3 * o['measured']:8.1f} {spread:6.0%} "
              + ("" if several else f"{1e3 * o['predicted']:8.1f} ")
              + (f"{_span_text(o['range']):>13} " if ranged else "")
              + " ".join(f"{e:+6.0%}" for e in errors) + (f" {max(errors) - min(errors):6.0%}" if several else ""))
    print()
    for out in checks:
        errors = sorted(abs(o["error"]) for o in out)
        covered = [o["covered"] for o in out if o["covered"] is not None]
        coverage = (f"; inside the stated range: {sum(covered)} of {len(covered)} "
                    f"({sum(covered) / len(covered):.0%})" if covered else "")
        print(f"{len(errors)} settings: median absolute error {statistics.median(errors):.1%}, worst "
              f"{errors[-1]:.0%}, within 10 %: {sum(e <= 0.10 for e in errors)}, within 20 %: "
              f"{sum(e <= 0.20 for e in errors)}" + coverage)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", action="append", required=True,
                        help="the codec's calibration; its per-cluster copies beside it (repeatable: the settings "
                             "predicted with each, side by side)")
    parser.add_argument("--rows", action="append", required=True,
                        help="FILE[:TENSORS] of netns_cluster rows (repeatable; a setting in several: every invocation)")
    parser.add_argument("--rates", help="only the settings at these link rates (comma-separated, as rows name them)")
    parser.add_argument("--timelines", default=str(DOCS / "perf_model_timelines.json"))
    parser.add_argument("--json", help="write every setting's prediction here (with the first calibration)")
    args = parser.parse_args()
    profiles = json.loads(pathlib.Path(args.timelines).read_text())
    timelines = {RESNET18: [(n, at) for n, at in profiles[RESNET18]["timeline"]]}
    rows = [s for s in settings(args.rows) if not args.rates or s[0]["rate"] in args.rates.split(",")]
    checks = [check(rows, pathlib.Path(c), timelines) for c in args.calibration]
    report(checks)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(checks[0], indent=1) + "\n")


if __name__ == "__main__":
    main()
