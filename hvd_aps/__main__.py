"""Command line: `python -m hvd_aps formats`, `python -m hvd_aps probe --format e4m3 --ranks 8`,
`python -m hvd_aps calibrate --out calibration.json`, `horovodrun ... python -m hvd_aps calibrate --links`
(or torchrun) and
`python -m hvd_aps plan --params 25M --compute-ms 120 --hosts 4 --links 1gbit,10gbit [--fsdp 8 [--hsdp]]`
(or `plan --profile step.json`, a step hvd_aps.step_profile measured; `--pipeline`, `--tensor` or
`--diloco H` plan those layouts)."""
import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
from typing import Optional

from . import _diloco_schedule, calibration, codec, emulate, fidelity, perf, perf_layouts, step_profile
from .formats import PRESETS, FloatFormat

_COUNT = re.compile(r"^\s*([0-9.]+)\s*([kmb]?)\s*$", re.IGNORECASE)
_COUNT_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}
# plan --pin: a predicted step this much shorter than the other path's decides without trial steps
PIN_MARGIN = 0.25


COEFFICIENTS = (("fixed", 1e3), ("per_tensor", 1e3), ("per_element", 1e9))  # calibrate's columns, their scales


def _table(header, rows):
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def formats_command(_args):
    rows = [(name, f.bits, f.variant, f"{f.max:g}", f"{f.min_normal:g}", f"{f.min_subnormal:g}",
             f.ml_dtypes_name or "-") for name, f in PRESETS.items()]
    print(_table(["format", "bits", "variant", "max", "min normal", "min subnormal", "ml_dtypes twin"], rows))
    print(f"\ncodec engine: {codec.engine_name()}")


def probe_command(args):
    print(f"{args.ranks} emulated ranks, {args.size} float32 Gaussian(0, {args.sigma:g}) each, "
          f"error of the averaged result against the exact mean")
    rows = []
    for name in args.format:
        for fmt, scaling, acc, err in emulate.probe(name, args.ranks, args.size, args.sigma, args.seed):
            rows.append((fmt, scaling, acc, f"{err:.3e}"))
    print(_table(["format", "scaling", "accumulate", "relative error"], rows))


def calibrate_command(args):
    if args.links:
        return _calibrate_links(args)
    if args.entry_points or args.sharing:
        raise SystemExit("--entry-points and --sharing need --links (in a horovodrun or torchrun job)")
    print(f"timing the codes exchange as rank 0 of {args.world} ranks ({calibration.engine_name(args.device)} "
          f"engine)...", file=sys.stderr)
    result = calibration.calibrate([str(f) for f in args.format], args.world, device=args.device)
    calibration.save(result, args.out)
    measured = calibration.parse(result)
    drawn = calibration.draws(measured)
    rows = [(fmt, *(_with_range(getattr(codec_of, field), [getattr(d.codecs[fmt], field) for d in drawn], scale)
                    for field, scale in COEFFICIENTS))
            for fmt, codec_of in measured.codecs.items()]
    print(_table(["format", "ms per exchange", "ms per tensor", "ns per element"], rows))
    print(f"(in brackets: the central {calibration.RANGE} % of {len(drawn)} fits of these timings, each "
          f"bucket's repeats drawn again; python -m hvd_aps plan gives each prediction's range alike)")
    print(f"\nfloat32 copies through host memory, every core at once: {result['copy'] * 1e9:.3f} ns per element")
    print(f"written to {args.out}")


def _with_range(value: float, drawn: list, scale: float) -> str:
    """A fitted coefficient and the range its draws span, in the table's unit."""
    low, high = calibration.spread(drawn)
    return f"{value * scale:.3f} ({low * scale:.3f}-{high * scale:.3f})"


def _calibrate_links(args):
    """Inside a job launched by horovodrun (Horovod's allreduce) or torchrun (torch.distributed's,
    Gloo; NCCL where CUDA is there): time the framework's float32 allreduce at several sizes on
    every rank and fit the link; with --entry-points, each path's costs in the job and the
    contention of codec and compute (hvd_aps.entry_costs); rank 0 adds them to --out."""
    from . import entry_costs  # torch, and Horovod under horovodrun
    if "HOROVOD_RANK" in os.environ:
        job = entry_costs.HorovodJob()
    elif "RANK" in os.environ:
        job = entry_costs.TorchJob()
    else:
        raise ValueError("calibrate --links measures a running job: launch it on every host with horovodrun "
                         "(horovodrun -np N -H ... python -m hvd_aps calibrate --links) or torchrun "
                         "(torchrun --nnodes H --nproc-per-node L ... -m hvd_aps calibrate --links)")
    try:
        _job_links(job, args)
    except BaseException:
        job.finish(clean=False)  # a rank that failed: the others may not be where it is
        raise
    job.finish()


def _job_links(job, args):
    """Time the job's link (and its entry points' costs) on its hosts x (world / hosts) ranks;
    rank 0 writes them."""
    formats = [str(f) for f in args.format]
    codecs = _agreed_codecs(job, args.out, formats) if args.entry_points else None
    per_host = job.world // job.hosts
    cluster = perf.Cluster(job.hosts, perf.Link(1.0), per_host, sharing=args.sharing or per_host)
    link, rows = calibration.time_links(job.allreduce, cluster)
    cluster = dataclasses.replace(cluster, between=link, inside=link if job.hosts == 1 else cluster.inside)
    costs = None
    if codecs:
        from . import entry_costs
        say = print if job.rank == 0 else (lambda *_, **__: None)
        costs = entry_costs.measure(job, dataclasses.replace(cluster, copy=codecs.copy or 0.0), formats,
                                    codecs.codecs, progress=lambda what: say(f"timing {what} in the job...",
                                                                             file=sys.stderr))
    if job.rank == 0:
        calibration.add_links(args.out, calibration.links_entry(link, cluster, rows, costs))
        print(f"{job.hosts} hosts x {per_host} ranks: {job.name}'s float32 allreduce gets "
              f"{_rate(link.bandwidth)} and {link.latency * 1e6:.0f} us a message step; written to {args.out}")
        if costs:
            _print_costs(costs)


def _agreed_codecs(job, out: str, formats: list) -> calibration.Calibration:
    """Rank 0's calibration in `out`, which --entry-points needs to hold every format's codec,
    the same on every rank (other hosts need not have the file)."""
    loaded, missing = None, formats
    if job.rank == 0 and pathlib.Path(out).exists():
        loaded = calibration.load(out)
        missing = [f for f in formats if f not in loaded.codecs]
    loaded, missing = job.allgather_object((loaded, missing))[0]
    if missing:  # every rank alike
        raise SystemExit(f"--entry-points needs the codec's calibration in rank 0's {out}: run python -m hvd_aps "
                         f"calibrate --format {' --format '.join(missing)} --out {out} first (one process, no launcher)")
    return loaded


def _print_costs(costs: dict) -> None:
    rows = [(entry.value, path, f"{cost.per_gradient * 1e6:.1f}", f"{cost.processor * 1e9:+.2f}")
            for entry, paths in costs["entry_points"].items() for path, cost in paths.items()]
    print(_table(["entry point", "path", "us a gradient", "ns an element beyond the model"], rows))
    print(f"contention: {costs['contention']:.2f} s of compute lost a second of codec time, "
          f"{costs['wire_contention']:.2f} a second of the float32 allreduce")


def plan_command(args):
    formats = [str(f) for f in args.format]
    if args.device is calibration.Device.CUDA and not args.calibration:
        args.calibration = calibration.GPU_PROJECTION
    loaded = calibration.load(args.calibration) if args.calibration else calibration.parse(
        calibration.calibrate(formats, args.hosts * args.ranks_per_host))
    codecs = loaded.codecs
    missing = [f for f in formats if f not in codecs]
    if missing:
        raise SystemExit(f"{args.calibration} has no calibration for {', '.join(missing)}: "
                         f"run python -m hvd_aps calibrate --format {missing[0]}")
    work = None if args.pipeline or args.tensor else _workload(args)
    step, split = _step_models(args)
    paths = loaded.paths(args.entry_point, formats)
    # on the CPU two levels run inside a host through its memory, at the rate calibrated (or measured now)
    copy = 0.0 if args.accelerator else loaded.copy or calibration.time_copy()
    sharing = args.sharing or (1 if args.accelerator else args.ranks_per_host)
    clusters = [perf.Cluster(args.hosts, _link(rate, args, loaded), args.ranks_per_host, copy=copy, sharing=sharing,
                             **loaded.contentions()) for rate in args.links.split(",")]
    if _layout_planned(args):
        _plan_layout(args, work, paths, clusters)
        return
    levels = " (two levels)" if clusters[0].two_levels and not args.fsdp else ""
    print(f"{work.parameters:,} parameters, {work.compute * 1e3:g} ms compute a step, {args.hosts} hosts x "
          f"{args.ranks_per_host} ranks{levels}, " + (
              f"{'HSDP' if args.hsdp else 'FSDP2'} in {args.fsdp} units ({'no ' if args.no_reshard else ''}resharding "
              f"after forward, the parameters gathered {_gathered(args)}): the framework's {_fsdp_peer(args)}"
              if args.fsdp else "the framework's allreduce") +
          " against codes" +
          f" through {args.entry_point.value}'s entry point; predicted step (x float32's), what its exchanges spend, "
          f"and the averaged gradient's relative error as measured at "
          f"{fidelity.nearest_world(args.hosts * args.ranks_per_host)} workers (docs/accuracy.md)")
    if not args.fsdp:
        _say_costs(loaded, args.entry_point, clusters[0].sharing)
    if args.device is calibration.Device.CUDA:
        print(f"(on a GPU: {loaded.describe()})")
    drawn = calibration.draws(loaded)
    _say_range(drawn, args.calibration)
    for rate, cluster in zip(args.links.split(","), clusters):
        rows = perf.table(work, paths, cluster, step)
        ranges = _ranges(drawn, loaded, cluster, lambda d, c: perf.table(work, d.paths(args.entry_point, formats), c,
                                                                         step))
        print(f"\n{rate} between hosts: fastest {min(rows, key=lambda row: row[1])[0].name}")
        ranged = ["range ms"] if ranges else []
        print(_table(["path", "step ms", *ranged, "x float32", "on the links ms", "processor ms", "error"],
                     [(p.name, f"{t * 1e3:.1f}", *([_range_text(ranges[p.name])] if ranges else []), f"{x:.2f}",
                       *(f"{v * 1e3:.1f}" for v in split(work, p, cluster)),
                       _error(p.name, args.hosts * args.ranks_per_host)) for p, t, x in rows]))
    print()
    for path in paths[2:]:
        edge = min(perf.break_even(work, path, peer, clusters[0], step=step) or 0.0 for peer in paths[:2])
        print(f"{path.name} is faster than both below {_rate(edge)} between hosts" if edge else
              f"{path.name} is faster than neither at any link speed from 1 Mbit/s up")
    if args.pin:
        _write_pin(args.pin, work, paths, clusters, step)
    if args.plot:
        _plot(args.plot, work, paths, clusters[0], step)


def _plan_layout(args, work: Optional[perf.Workload], paths, clusters) -> None:
    """The predicted step of a pipeline (one stage a host), tensor-parallel layers (one shard a
    rank) or DiLoCo's inner steps beside data parallelism's (`work`), a row a path at every link."""
    if args.pipeline:
        layout = perf_layouts.Pipeline(args.hosts, args.microbatches, args.activations, args.compute_ms / 1e3,
                                       args.optimizer_ms / 1e3)
        models = {"": functools.partial(perf_layouts.pipeline_step, layout)}
        print(f"a pipeline of {args.hosts} stages (one a host), 1F1B over {args.microbatches} micro-batches of "
              f"{args.activations:,} activations a boundary, {args.compute_ms:g} ms compute a stage; MB: what "
              f"crosses a boundary each way")
    elif args.tensor:
        layout = perf_layouts.TensorParallel.sequence_parallel(
            args.blocks, args.activations, args.compute_ms / 1e3, args.projections, args.optimizer_ms / 1e3,
            args.collective_ms / 1e3)
        models = {"": functools.partial(perf_layouts.tensor_parallel_step, layout, gloo=not args.accelerator)}
        print(f"{args.blocks} transformer blocks sharded over {clusters[0].world} ranks, sequence parallel, "
              f"{args.activations:,} activations a collective, {args.compute_ms:g} ms compute a rank, "
              f"{args.collective_ms:g} ms a collective beyond its link; MB: what a rank sends")
    else:
        schedule = _diloco_schedule.Schedule(args.diloco, args.fragments, args.delay)
        models = {"data parallel ": lambda path, c: (perf.step_time(work, path, c),
                                                     perf_layouts.exchange_bytes(work.parameters, path, c.world)),
                  "DiLoCo ": functools.partial(perf_layouts.diloco_step, work, schedule)}
        print(f"{work.parameters:,} parameters, {work.compute * 1e3:g} ms compute a step: data parallelism against "
              f"DiLoCo syncing every {args.diloco} steps ({args.fragments} fragment(s), each applied {args.delay} "
              f"steps after it starts; a DiLoCo row: an inner step on average); MB: what a rank sends a step in a "
              f"flat exchange")
    for rate, cluster in zip(args.links.split(","), clusters):
        rows = [(kind + path.name, *model(path, cluster)) for kind, model in models.items() for path in paths]
        print(f"\n{rate}: fastest {min(rows, key=lambda row: row[1])[0]}")
        print(_table(["path", "step ms", "x float32", "MB a step"],
                     [(name, f"{t * 1e3:.1f}", f"{t / rows[0][1]:.2f}", f"{sent / 1e6:.3f}")
                      for name, t, sent in rows]))


def _say_costs(loaded: calibration.Calibration, entry: perf.EntryPoint, sharing: float) -> None:
    """What the plan takes from the job's calibration, or a note where it has nothing for `entry`."""
    native = entry.native
    if not {entry, native} <= loaded.entry_points.keys():
        launcher = "torchrun" if entry is perf.EntryPoint.DDP else "horovodrun"
        print(f"note: no cost a gradient measured for {entry.value}'s paths in the calibration (the codec's alone): "
              f"{launcher} ... -m hvd_aps calibrate --links --entry-points measures them", file=sys.stderr)
        return
    costs = {**loaded.entry_points[native], **loaded.entry_points[entry]}
    print("measured in a job: " + ", ".join(f"{path} {cost.per_gradient * 1e6:.0f} us a gradient"
                                            for path, cost in costs.items())
          + f"; the exchange takes {loaded.contention:.0%} of the cores beside compute while its codec runs, "
            f"{loaded.wire_contention:.0%} while its bytes travel")
    if loaded.sharing is not None and loaded.sharing != sharing:
        print(f"note: those costs were measured with {loaded.sharing:g} ranks sharing a machine's cores, planned "
              f"with {sharing:g} (--sharing)", file=sys.stderr)


def _say_range(drawn: list, file: Optional[str]) -> None:
    """How plan's ranges are found, or why there are none."""
    if drawn:
        print(f"range: the central {calibration.RANGE} % of the step predicted by {len(drawn)} fits of the "
              f"calibration's own timings, each timing's repeats drawn again (a bootstrap): what the calibration's "
              f"noise moves, not how far a cluster's steps move from run to run")
    else:
        print(f"note: no ranges: {file or 'the calibration'} kept no repeated timings (python -m hvd_aps calibrate "
              f"writes them)", file=sys.stderr)


def _ranges(drawn: list, loaded: calibration.Calibration, cluster: perf.Cluster, table) -> dict:
    """{path name: (low, high) step seconds} over the draws: table(draw, cluster) of each, the
    cluster's link the draw's where it is the link the calibration measured."""
    steps = {}
    for draw in drawn:
        between = draw.link if loaded.link is not None and cluster.between == loaded.link else cluster.between
        for path, seconds, _ in table(draw, dataclasses.replace(cluster, between=between)):
            steps.setdefault(path.name, []).append(seconds)
    return {name: calibration.spread(values) for name, values in steps.items()}


def _range_text(span: tuple) -> str:
    return f"{span[0] * 1e3:.1f}-{span[1] * 1e3:.1f}"


def _error(path: str, world: int) -> str:
    measured = fidelity.error(path, world)
    return "-" if measured is None else f"{100 * measured:.1f} %"


def _workload(args) -> perf.Workload:
    """The step planned: from a saved step profile (its compute and its gradients' timeline), or
    from --params and --compute-ms; in --fsdp units where FSDP2 is planned."""
    profile = step_profile.load(args.profile) if args.profile else None
    parameters = profile.parameters if profile else args.params
    buckets = perf.fsdp_units(parameters, args.fsdp) if args.fsdp else perf.entry_buckets(parameters, args.entry_point)
    options = {"buckets": buckets, "shared_processor": not args.accelerator}
    if profile:
        return profile.workload(**options)
    return perf.Workload(parameters, args.compute_ms / 1e3, optimizer=args.optimizer_ms / 1e3, tensors=args.tensors,
                         **options)


def _link(rate: str, args, loaded: calibration.Calibration) -> perf.Link:
    """A rate as tc names it, or "measured": the link `calibrate --links` measured in a job."""
    if rate != "measured":
        return perf.Link.parse(rate, args.latency_us / 1e6)
    if loaded.link is None:
        raise ValueError("--links measured needs a --calibration file with a link measured in a job: "
                         "horovodrun (or torchrun) ... -m hvd_aps calibrate --links --out FILE")
    if loaded.link_shape != (args.hosts, args.ranks_per_host):
        print(f"note: the link was measured on {loaded.link_shape[0]} hosts x {loaded.link_shape[1]} ranks, "
              f"planned on {args.hosts} x {args.ranks_per_host}", file=sys.stderr)
    return loaded.link


def _step_models(args):
    """(the step model, the exchanges' breakdown) of the planned path: the bucket exchanges, or
    FSDP2's reduce-scatters (Gloo's moving an allreduce's bytes on the CPU, NCCL's on an
    accelerator)."""
    if not args.fsdp:
        return perf.step_time, perf.breakdown
    options = dict(reshard=not args.no_reshard, gloo=not args.accelerator)
    split = perf.hsdp_breakdown if args.hsdp else perf.fsdp_breakdown
    if not args.gather:
        return functools.partial(perf.fsdp_step_time, hsdp=args.hsdp, **options), functools.partial(split, **options)

    def step(work, path, cluster):  # each row's parameters gathered in its own precision
        return perf.fsdp_step_time(work, path, cluster, hsdp=args.hsdp, gather=path, **options)
    return step, lambda work, path, cluster: split(work, path, cluster, gather=path, **options)


def _gathered(args) -> str:
    return "in each path's precision (16-bit: bfloat16, codes: codes)" if args.gather else "in float32"


def _fsdp_peer(args) -> str:
    """What codes replace on the planned FSDP2 path."""
    return "allreduce of each shard across hosts" if args.hsdp else "reduce-scatter"


def _write_pin(path, work, paths, clusters, step):
    """policy="auto"'s decision where the model is sure of it: codes (the first --format) or the
    framework's float32 allreduce where one step is predicted PIN_MARGIN shorter than the other,
    nothing (the trial steps decide) on a closer call. Written for APSCompressor.pin()."""
    if len(clusters) != 1:
        raise ValueError("--pin needs one link speed (--links): the decision holds for one cluster")
    codes, native = (step(work, p, clusters[0]) for p in (paths[2], paths[0]))
    policy = "codes" if codes < (1 - PIN_MARGIN) * native else "native" if native < (1 - PIN_MARGIN) * codes else None
    pathlib.Path(path).write_text(json.dumps({"policy": policy} if policy else {}) + "\n")
    verdict = f"pin policy {policy!r}" if policy else "no pin: policy='auto' times the trial steps"
    print(f"\n{paths[2].name} {1e3 * codes:.1f} ms against float32 {1e3 * native:.1f} ms: {verdict} ({path}; "
          f"load it with compressor.pin(json.load(open({str(path)!r}))))")


def _plot(path, work, paths, cluster, step):
    """Predicted step against the link speed between hosts, one line a path (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gbits = [0.1 * 10 ** (k / 20) for k in range(61)]  # 0.1 to 100 Gbit/s
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, steps in perf.sweep(work, paths, cluster, [g * 1e9 / 8 for g in gbits], step).items():
        ax.plot(gbits, [1e3 * t for t in steps], label=name)
    ax.set(xscale="log", yscale="log", xlabel="link between hosts, Gbit/s", ylabel="predicted step, ms",
           title=f"{work.parameters:,} parameters, {cluster.hosts} x {cluster.ranks_per_host} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def _rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def _count_arg(text):
    m = _COUNT.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"a count like 25M, 1.3B or 4096, got {text!r}")
    return int(float(m.group(1)) * _COUNT_SCALE[m.group(2).lower()])


def _format_arg(name):
    try:
        return FloatFormat.parse(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _layout_planned(args) -> bool:
    """plan was asked for a pipeline, tensor-parallel layers or DiLoCo, not a data-parallel step."""
    return args.pipeline or args.tensor or args.diloco is not None


def _check_probe(parser, args) -> None:
    if args.ranks < 1 or args.size < 1:
        parser.error("--ranks and --size must be positive")


def _check_plan(parser, args) -> None:
    """plan's options together: one step to plan, and what each option needs."""
    if args.profile and (args.params is not None or args.compute_ms is not None):
        parser.error("plan a step from --params and --compute-ms, or from a saved --profile (not both)")
    _check_layout(parser, args)
    if not (args.pipeline or args.tensor or args.profile) and (args.params is None or args.compute_ms is None):
        parser.error("plan needs --params and --compute-ms (or a saved --profile)")
    if (args.hsdp or args.gather) and not args.fsdp:
        parser.error("--hsdp and --gather plan FSDP2's units: give --fsdp UNITS too")
    if args.device is calibration.Device.CUDA:
        args.accelerator = True
    if args.entry_point is not perf.EntryPoint.DDP and args.fsdp:
        parser.error(f"--entry-point {args.entry_point.value} plans a Horovod job; FSDP2 (--fsdp) runs on "
                     f"torch.distributed")


def _check_layout(parser, args) -> None:
    """plan's layouts: one at a time, with what each needs; the data-parallel options refused."""
    layouts = [name for name, on in (("--pipeline", args.pipeline), ("--tensor", args.tensor),
                                     ("--diloco", args.diloco is not None), ("--fsdp", args.fsdp)) if on]
    if len(layouts) > 1:
        parser.error(f"plan one layout at a time, got {' and '.join(layouts)}")
    if not _layout_planned(args):
        return
    if args.pin or args.plot:
        parser.error(f"--pin and --plot plan data parallelism's exchange, not {layouts[0]}")
    if args.diloco is not None:
        return
    if args.activations is None or args.compute_ms is None or args.profile:
        parser.error(f"{layouts[0]} needs --activations and --compute-ms (not a --profile)")
    if args.entry_point is not perf.EntryPoint.DDP:
        parser.error(f"{layouts[0]} runs torch.distributed's collectives: --entry-point {args.entry_point.value} "
                     f"does not apply")
    if args.pipeline and (args.hosts < 2 or args.ranks_per_host != 1):
        parser.error("--pipeline plans one stage a host: 2 or more --hosts of one rank")
    if args.tensor and args.hosts * args.ranks_per_host < 2:
        parser.error("--tensor shards over 2 or more ranks")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hvd_aps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("formats", help="table of the preset formats").set_defaults(run=formats_command)
    probe = sub.add_parser("probe", help="emulated N-rank allreduce error, with and without APS")
    probe.add_argument("--format", action="append", type=_format_arg,
                       help="format name (repeatable); default e4m3 and e3m0")
    probe.add_argument("--ranks", type=int, default=8)
    probe.add_argument("--size", type=int, default=100_000)
    probe.add_argument("--sigma", type=float, default=1e-4)
    probe.add_argument("--seed", type=int, default=0)
    probe.set_defaults(run=probe_command, check=_check_probe)
    cal = sub.add_parser("calibrate", help="time the codes exchange on this machine for the performance model")
    cal.add_argument("--format", action="append", type=_format_arg, help="format (repeatable); default e4m3 and e3m0")
    cal.add_argument("--world", type=int, default=2, help="ranks the timed rank stands among")
    cal.add_argument("--device", type=calibration.Device, choices=list(calibration.Device),
                     default=calibration.Device.CPU,
                     help="where the codec runs: cuda times the CuPy engine's kernels on this GPU")
    cal.add_argument("--out", default="hvd_aps_calibration.json")
    cal.add_argument("--links", action="store_true", help="inside a horovodrun or torchrun job: measure the link the "
                                                          "framework's allreduce gets and add it to --out (plan --links "
                                                          "measured, HVD_APS_LINK)")
    cal.add_argument("--entry-points", action="store_true",
                     help="with --links: also each path's costs in the job (a gradient, an element) and how much "
                          "the codec slows compute (a few minutes; --out must hold the codec's calibration)")
    cal.add_argument("--sharing", type=float, help="with --links: ranks sharing one machine's cores (default: the "
                                                   "ranks a host)")
    cal.set_defaults(run=calibrate_command)
    plan = sub.add_parser("plan", help="predicted step time of each path and format, and where codes pay")
    plan.add_argument("--params", type=_count_arg, help="gradient elements, e.g. 25M")
    plan.add_argument("--tensors", type=_count_arg, help="gradient tensors (default: one a DDP bucket)")
    plan.add_argument("--compute-ms", type=float, help="forward + backward of one rank, ms")
    plan.add_argument("--optimizer-ms", type=float, default=0.0)
    plan.add_argument("--profile", help="a step profile (hvd_aps.step_profile.save) in place of --params, "
                                        "--tensors, --compute-ms and --optimizer-ms: its gradients' timeline too")
    plan.add_argument("--hosts", type=int, default=2)
    plan.add_argument("--ranks-per-host", type=int, default=1)
    plan.add_argument("--links", default="1gbit,10gbit,100gbit",
                      help="rates between hosts, comma-separated; 'measured': the link in --calibration")
    plan.add_argument("--latency-us", type=float, default=perf.DEFAULT_LATENCY * 1e6, help="between hosts, us")
    plan.add_argument("--format", action="append", type=_format_arg, help="format (repeatable); default e4m3, e3m0")
    plan.add_argument("--calibration", help="a file from python -m hvd_aps calibrate (default: calibrate now)")
    plan.add_argument("--entry-point", type=perf.EntryPoint, choices=list(perf.EntryPoint), default=perf.EntryPoint.DDP,
                      metavar="{" + ",".join(e.value for e in perf.EntryPoint) + "}",
                      help="where gradients are handed over: horovod (hvd.DistributedOptimizer: Horovod's fused "
                           "allreduce, the one line's codes one collective at a time), codes "
                           "(hvd_aps.torch.DistributedOptimizer), ddp (DDP and its hooks; default); with its costs "
                           "a gradient where --calibration measured them (calibrate --links --entry-points)")
    plan.add_argument("--sharing", type=float, help="ranks sharing one machine's cores (default: the ranks a host; "
                                                    "1 with --accelerator)")
    plan.add_argument("--accelerator", action="store_true", help="compute runs on an accelerator, not the codec's CPU")
    plan.add_argument("--device", type=calibration.Device, choices=list(calibration.Device),
                      default=calibration.Device.CPU,
                      help="where the codec runs: cuda plans it on a GPU (compute there too) with the GPU "
                           "codec projected from its kernels' work, or --calibration's measured one")
    plan.add_argument("--fsdp", type=_count_arg, help="plan FSDP2 with this many units of equal size (reduce-scatters "
                                                      "and all-gathers) in place of bucket allreduces")
    plan.add_argument("--no-reshard", action="store_true", help="FSDP2 with reshard_after_forward=False")
    plan.add_argument("--gather", action="store_true", help="with --fsdp: each path gathers the parameters in its "
                      "own precision (16-bit: a MixedPrecisionPolicy's bfloat16 param_dtype; codes: "
                      "hvd_aps.fsdp.apply(params=...)); default: every path gathers them in float32")
    plan.add_argument("--hsdp", action="store_true", help="with --fsdp: HSDP, sharded inside each host and replicated "
                                                          "across hosts (codes only across hosts)")
    plan.add_argument("--pipeline", action="store_true", help="plan a pipeline of one stage a host (1F1B), "
                                                              "with --microbatches and --activations")
    plan.add_argument("--tensor", action="store_true", help="plan tensor-parallel transformer blocks over every rank "
                                                            "(sequence parallel), with --blocks and --activations")
    plan.add_argument("--microbatches", type=int, default=8, help="--pipeline: micro-batches a step")
    plan.add_argument("--activations", type=_count_arg, help="--pipeline: values a micro-batch sends across a "
                      "boundary; --tensor: values of a step's activation (sequences x length x width)")
    plan.add_argument("--blocks", type=int, default=1, help="--tensor: transformer blocks")
    plan.add_argument("--projections", type=int, default=3, help="--tensor: attention's gathered inputs (3: q, k "
                                                                  "and v apart; 1: one gather for all three)")
    plan.add_argument("--collective-ms", type=float, default=0.0,
                      help="--tensor: what each collective costs beyond its link (DTensor's redistribution, the "
                           "autograd Function; examples/model_parallel_check.py fits it on a float32 step)")
    plan.add_argument("--diloco", type=int, metavar="H", help="plan DiLoCo syncing every H inner steps beside data "
                                                              "parallelism (--params: the parameters synced)")
    plan.add_argument("--fragments", type=int, default=1, help="--diloco: Streaming DiLoCo's fragments")
    plan.add_argument("--delay", type=int, default=0, help="--diloco: inner steps an exchange runs beside")
    plan.add_argument("--plot", help="draw the predicted step against link speed into this file (matplotlib)")
    plan.add_argument("--pin", help="write policy='auto''s decision here where the prediction is clear "
                                    "(for APSCompressor.pin), else an empty pin: the trials decide")
    plan.set_defaults(run=plan_command, check=_check_plan)
    args = parser.parse_args(argv)
    if "format" in vars(args):
        args.format = args.format or [FloatFormat.parse("e4m3"), FloatFormat.parse("e3m0")]
    if "check" in vars(args):
        args.check(parser, args)
    try:
        args.run(args)
    except (ValueError, OSError) as bad:  # a link rate, a cluster shape or a calibration file
        parser.error(str(bad))


if __name__ == "__main__":
    sys.exit(main())
