"""The performance model (hvd_aps.perf) against the step times the netns cluster measured
(docs/cluster/*.json: MLP, two huge layers, LM, ResNet-18 and transformer profiles; 2 and 4 hosts;
1, 2 and 4 ranks a host; 1 Gbit/s, 10 Gbit/s and uncapped; Horovod, DDP, FSDP2 and HSDP; fp32,
fp16, e4m3, e3m0).

Protocol: the codes exchange's own time and the host's float32 copy rate come from `python -m
hvd_aps calibrate` on this machine (--calibration, or calibrated now), for the rows whose tree
had the exchange's block tables (their `tree` descends from TABLES_COMMIT); the rows recorded
before it, whose exchange cost hundreds of microseconds a tensor, take the calibration made then
(--calibration-pieces); each row's compute (forward,
backward, optimizer) is the one its benchmark measured; each link class (a rate) gets one effective
bandwidth and latency, fitted on the Horovod and DDP fp32 rows of that rate (the frameworks' own
allreduce: what a link delivers to Gloo over TCP through tc is not its nominal rate), and the
uncapped link's fit stands for the link among a host's ranks too (HSDP's collectives inside a host:
Gloo over its namespace's loopback); each framework's 16-bit allreduce gets one processor cost per
element its ring reduces (hvd_aps.perf.Path.processor), fitted on its uncapped 16-bit rows, where
the link matters least, and so does each framework's codes path (per element its codec handles,
beyond the codec's calibrated time: what the same passes cost more inside the job than alone),
fitted on its uncapped codes rows (below zero where the codec ran faster when the rows were recorded
than when it is calibrated; torch's 16-bit cost, fitted on DDP's rows, serves FSDP2's too, and
FSDP2's codes take the codec's time alone). Every other row (16-bit and codes rows on a capped link,
and every FSDP2 row, its float32 reduce-scatter included: hvd_aps.perf.fsdp_step_time, HSDP's too)
is then predicted, not fitted. Horovod's codes paths are modelled with their chunks' codec and wire
adding up (hvd_aps.perf.Path.pipelined=False: one collective at a time on Horovod's background
thread), the DDP hook's overlapping. Each two-level row's host level is the one its tree ran (HOST_LEVELS:
over TCP, or 6, 4 or 3 float32 passes through shared memory). policy="auto" rows are left out (the model
does not run the trials). The last line is the rows' own spread: how far the invocations of a setting
measured more than once lie from their median.
The summary is given for every row and for the rows run with OpenMP's idle workers waiting passively
(the row's omp_wait_policy, netns_cluster.py's default since 2026-11-24): in older rows spinning
workers of one simulated host took the cores of another, which no cluster of separate machines sees.

    .venv/bin/python examples/perf_model_check.py [--calibration docs/perf_model_calibration.json] \
        [--json docs/perf_model.json] [--plot docs/perf_model.png]
"""
import argparse
import functools
import glob
import itertools
import json
import pathlib
import statistics
import subprocess

import torch

import recipes
from hvd_aps import calibration, perf, step_profile
from synthetic_models import inputs, loss_fn, model as build_model

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
TWO_LEVEL_BYTES = 0.25  # a host's bytes x an fp32 ring's under which a row of several ranks a host ran two levels
FORMATS = {"e4m3": 8, "e3m0": 4}
PROFILE_ARGS = {  # (profile, parameters) -> the synthetic benchmark's arguments that build it
    ("mlp", 16785408): dict(hidden=2048), ("mlp", 4198400): dict(hidden=1024), ("large", 16783360): {},
    ("resnet18", 11689512): dict(image_size=112), ("transformer", 18915328): dict(hidden=512, blocks=6),
    ("lm", 23083008): dict(hidden=512, blocks=2, vocab=16384),
    ("tensors300x20000", 6000000): dict(profile="tensors", tensors=300, tensor_elements=20000),
    ("tensors2x3000000", 6000000): dict(profile="tensors", tensors=2, tensor_elements=3000000),
    ("tensors400x10000", 4000000): dict(profile="tensors", tensors=400, tensor_elements=10000)}
# the `tensors` profile's rows hold the same parameters in different tensors: its files' shapes, by name
TENSOR_FILES = {**dict.fromkeys(("tensors300_1gbit", "tensors300_trimmed_1gbit", "tensors300_lastbatch_1gbit",
                                  "tensors300_1gbit_cpu", "tensors300_1gbit_floor", "tensors300_1gbit_threads"),
                                 "tensors300x20000"),
                **dict.fromkeys(("tensors2_1gbit", "tensors2_trimmed_1gbit", "tensors2x3m_1gbit_cpu",
                                 "tensors2x3m_1gbit_floor", "tensors2x3m_1gbit_threads"), "tensors2x3000000"),
                **dict.fromkeys(("tensors400_1gbit", "tensors400_1gbit_cbe1851"), "tensors400x10000")}
# the host level of two levels as the tree that recorded a file ran it (by the commits that changed it;
# every other file: the model's perf.HOST_COPIES, as the code now runs it), as the Cluster's keywords:
# over TCP on loopback (process sets and Gloo subgroups, before d285d71 put it in shared memory: no
# copy rate, so over the `inside` link), else its float32 passes an element (6 until a647df1/d3ce2a2
# read straight from the boxes, 4 until 977eaee stopped concatenating)
OVER_TCP = {"copy": 0.0}
HOST_LEVELS = {**dict.fromkeys(("hosts2x2_mlp", "hosts2x4_mlp4m", "levels2x2_before_1", "levels2x2_before_2"),
                               OVER_TCP),
               **dict.fromkeys(("levels2x2_after_1", "levels2x2_after_2", "passive_mlp_2x2", "passive_large_2x4",
                                "passive_mlp4m_2x4"), {"host_copies": 6}),
               **dict.fromkeys((f"copies_large_2x{k}" for k in ("2_1", "2_2", "2_3", "4_1", "4_2")),
                               {"host_copies": 4})}
# the commit whose exchange runs one engine call a stage over block tables (per bucket, not per tensor)
TABLES_COMMIT = "b9aa8d4"
GIT_S = 30  # a git query of the checkout
ERAS = ("pieces", "tables")  # era(): the rows before TABLES_COMMIT and after
LATENCIES = (0.0, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3)
TIMELINES = {}  # (profile, parameters) -> its gradients' timeline (gradient_timelines)
PROCESSOR_COSTS = [0.0] + [0.1e-9 * 1.1 ** k for k in range(60)]  # s per element: the processor fits' grid
# a codes path's cost in the job may fall short of the codec's calibration too: the calibration is taken on
# the machine at hand, today, and the rows were recorded on other days, when the codec ran faster or slower
CODES_COSTS = sorted({-c for c in PROCESSOR_COSTS} | set(PROCESSOR_COSTS))
# s each of Horovod's codes collectives costs beyond its link's latency (perf.HOROVOD_COLLECTIVE_S): the grid
COLLECTIVE_COSTS = (0.0, 0.5e-3, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 8e-3, 10e-3)
CODES_COST_MEANING = "codec handles, beyond the codec alone (below zero: it ran faster in the jobs than calibrated now)"


def measured_rows():
    rows = []
    for path in sorted(glob.glob(str(DOCS / "cluster" / "*.json"))):
        for r in json.loads(pathlib.Path(path).read_text()):
            if isinstance(r, dict) and "compute" in r and path_of(r["compression"]) is not None:
                stem = pathlib.Path(path).stem
                rows.append(dict(r, file=stem, profile=TENSOR_FILES.get(stem, r["profile"])))
    return rows


FSDP_PEERS = {"bf16-params": 32, "bf16": 16}  # FSDP2's bfloat16 parameters: its reduce-scatter's bits


def path_of(compression):
    """(framework, name, bits, format or None) of a cluster compression name, the gradients' path
    of an FSDP2 one (gather_of: its parameters'); None where left out (policy="auto", and the floor
    of Horovod's per-gradient path, which exchanges nothing)."""
    framework, _, name = compression.rpartition(":")
    name = name.partition(PARAMS)[0]
    if framework not in ("", "ddp", "fsdp") or name.endswith("-auto") or name == recipes.FLOOR:
        return None
    if framework == "fsdp" and name in FSDP_PEERS:
        return framework, name, FSDP_PEERS[name], None
    if name in ("none", "fp16"):
        return framework or "hvd", name, 32 if name == "none" else 16, None
    fmt = name.split("-", 1)[1]
    return (framework or "hvd", name, FORMATS[fmt], fmt) if fmt in FORMATS else None


PARAMS = "+params-"  # pytorch_fsdp_synthetic_benchmark.py: the parameters' codes follow


def gather_of(compression):
    """(bits, format or None) of an FSDP2 row's parameter gathers: float32, bfloat16 (its
    bf16 peers) or codes (+params-<format>)."""
    name = compression.rpartition(":")[2]
    grads, _, params = name.partition(PARAMS)
    if params:
        return FORMATS[params], params
    return (16, None) if grads in FSDP_PEERS else (32, None)


def profile_args(profile, params):
    """The synthetic benchmark's arguments that build a profile of `params` parameters (batch 2)."""
    return argparse.Namespace(**{"hidden": 2048, "blocks": 6, "vocab": 16384, "image_size": 112, "batch_size": 2,
                                 "profile": profile, **PROFILE_ARGS[(profile, params)]})


def shapes(profile, params, cache={}):
    """(gradient tensors, FSDP units' sizes: every block as pytorch_fsdp_synthetic_benchmark.py
    shards it, in backward's order, the root's own parameters last) of a profile."""
    key = (profile, params)
    if key not in cache:
        args = profile_args(profile, params)
        model = build_model(args.profile, args)[0]
        assert sum(p.numel() for p in model.parameters()) == params, key
        blocks = getattr(model, "blocks", model)
        units = [sum(p.numel() for p in child.parameters()) for child in blocks.children()]
        units = [n for n in reversed(units) if n]
        root = params - sum(units)  # the root module's own parameters, reduced last
        cache[key] = len(list(model.parameters())), units + [root] if root else units
    return cache[key]


def gradient_timelines(rows, path):
    """Per (profile, parameters) of the rows: its gradients' timeline (hvd_aps.step_profile, one
    thread, batch 2), the shape of the profile's backward that each row's own measured backward
    scales. Read from `path`; profiles it lacks are measured on this machine and added to it, so
    the check gives the same numbers on every run."""
    path = pathlib.Path(path)
    saved = json.loads(path.read_text()) if path.exists() else {}
    for profile, params in sorted({(r["profile"], r["params"]) for r in rows}):
        key = f"{profile}/{params}"
        if key not in saved:
            args = profile_args(profile, params)
            model, shape_in, shape_out = build_model(args.profile, args)
            x, y = inputs(args, shape_in, shape_out)
            saved[key] = step_profile.to_json(step_profile.measure(model, lambda: loss_fn(x)(model(x), y)))
            path.write_text(json.dumps(saved, indent=1) + "\n")
    return {(profile, int(params)): step_profile.from_json(v).timeline
            for profile, params, v in ((*k.split("/"), v) for k, v in saved.items())}


def fitted(r):
    """Whether a row is one the model is fitted on: Horovod's and DDP's float32 allreduce (the
    links), their uncapped 16-bit allreduce and codes (their processor costs)."""
    framework, name, _, _ = path_of(r["compression"])
    return framework != "fsdp" and (name == "none" or name != "none" and r["rate"] == "uncapped")


def processor_key(r) -> tuple:
    """Whose processor cost a row's path takes: (Horovod's or torch.distributed's (DDP and
    FSDP2), 16-bit allreduce or codes); None for float32."""
    framework, name, bits, fmt = path_of(r["compression"])
    if bits == 32:
        return None
    # a codes path's cost in the job corrects its era's calibration: fitted per era
    return ("hvd" if framework == "hvd" else "torch", "codes", era(r.get("tree"))) if fmt else \
        ("hvd" if framework == "hvd" else "torch", "16-bit")


def workload(r):
    framework, name, bits, fmt = path_of(r["compression"])
    compute = r["forward"] + r["backward"]
    n = r["params"]
    if framework == "fsdp":
        buckets = shapes(r["profile"], n)[1]
    elif framework == "ddp":
        buckets = perf.ddp_buckets(n)
    else:
        # codes in APSCompressor's buckets; Horovod's own allreduce as fusion buffers at the backward's end
        cap = perf.HOROVOD_FUSION_BYTES // perf.FLOAT32_BYTES
        buckets = perf.entry_buckets(n, perf.EntryPoint.HOROVOD) if fmt else [min(cap, n - i) for i in range(0, n, cap)]
    return perf.Workload(n, compute, r["backward"] / compute if compute else 1.0, r["optimizer"], buckets,
                         shapes(r["profile"], n)[0], TIMELINES[(r["profile"], n)])


def cluster(r, link, copy, inside):
    """The row's cluster: two levels where hosts held several ranks and its bytes show them (8-bit
    codes: about 0.17x an fp32 ring's bytes on two levels, 0.29-0.42x flat), through host memory
    at the calibrated `copy` rate (every rank runs on the CPU) in as many passes as the row's tree
    made, or over `inside` where that tree ran its host level over TCP (HOST_LEVELS); `inside`:
    what the framework's collectives among a host's ranks get (HSDP's all-gathers and
    reduce-scatters)."""
    n = r["hosts"] * r["ranks_per_host"]
    ring = r["params"] * perf.FLOAT32_BYTES * 2 * (n - 1) / n
    # every rank of the netns cluster runs on this one machine, whose cores the calibration had
    return perf.Cluster(r["hosts"], link, r["ranks_per_host"], inside,
                        hierarchical=r["tx_bytes_per_step"] < TWO_LEVEL_BYTES * ring, sharing=n,
                        **{"copy": copy, **HOST_LEVELS.get(r["file"], {})})


@functools.lru_cache(maxsize=None)
def era(tree) -> str:
    """"tables" where the row's tree (a commit, '+' where the checkout differed) has the block
    tables, else "pieces" (rows older than their trees' record too)."""
    if not tree:
        return "pieces"
    known = subprocess.run(["git", "merge-base", "--is-ancestor", TABLES_COMMIT, tree.rstrip("+")],
                           cwd=DOCS.parent, capture_output=True, timeout=GIT_S)
    return "tables" if known.returncode == 0 else "pieces"


def predict(r, link, calibrated, cost=(0.0, 0.0), inside=perf.Link(*perf.LOOPBACK)):
    """The row's predicted step; `cost`: its path's (processor cost, cost a collective) (processor_key);
    `inside`: the link among a host's ranks."""
    framework, name, bits, fmt = path_of(r["compression"])
    codecs, copies = calibrated
    made = era(r.get("tree"))
    c, hsdp = cluster(r, link, copies[made], inside), r.get("hsdp", False)
    codec = None if fmt is None else codecs[(made, fmt, c.hosts if c.two_levels or hsdp else c.world)]
    path = perf.Path(name, bits, codec, cost[0], pipelined=framework != "hvd", collective=cost[1])
    if framework == "fsdp":
        bits, params = gather_of(r["compression"])
        gather = perf.Path("params", bits, None if params is None else codecs[(made, params, c.world)])
        return perf.fsdp_step_time(workload(r), path, c, r.get("reshard", True), gloo=True, hsdp=hsdp, gather=gather)
    return perf.step_time(workload(r), path, c)


def fit_links(rows, calibrated):
    """Per rate: the Link (bandwidth, latency) that predicts its fp32 rows best."""
    links = {}
    candidates = [perf.Link(gbit * 1e9 / 8, latency)
                  for gbit, latency in itertools.product([0.1 * 1.05 ** k for k in range(160)], LATENCIES)]
    for rate in sorted({r["rate"] for r in rows}):
        fp32 = [r for r in rows if r["rate"] == rate and fitted(r) and path_of(r["compression"])[2] == 32]
        links[rate] = _least_error(candidates, fp32, lambda r, link: predict(r, link, calibrated))
    return links


def fit_processor_costs(rows, links, calibrated):
    """Per processor_key: the (processor cost, cost a collective) that predicts its uncapped rows
    best ((0, 0) where it has none); a cost a collective on Horovod's codes paths only."""
    costs = {None: (0.0, 0.0)}
    keys = [*itertools.product(("hvd", "torch"), ("16-bit",)), *itertools.product(("hvd", "torch"), ("codes",), ERAS)]
    for key in keys:
        own = [r for r in rows if fitted(r) and processor_key(r) == key]
        grid = itertools.product(CODES_COSTS if key[1] == "codes" else PROCESSOR_COSTS,
                                 COLLECTIVE_COSTS if key[:2] == ("hvd", "codes") else (0.0,))
        costs[key] = _least_error(list(grid), own, lambda r, cost: predict(r, links[r["rate"]], calibrated, cost)
                                  ) if own else (0.0, 0.0)
    return costs


def _least_error(candidates, rows, predict_with):
    """The candidate whose predictions of `rows` (predict_with(row, candidate)) have the least
    median relative error."""
    return min(candidates, key=lambda k: statistics.median(abs(predict_with(r, k) / r["step_median"] - 1) for r in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", help="python -m hvd_aps calibrate's file (default: calibrate now)")
    parser.add_argument("--calibration-pieces", default=str(DOCS / "perf_model_calibration_pieces.json"),
                        help="the calibration of the exchange before TABLES_COMMIT, for the rows recorded then")
    parser.add_argument("--plot", help="write the predicted-against-measured scatter here")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--timelines", default=str(DOCS / "perf_model_timelines.json"),
                        help="the profiles' gradient timelines (measured into it where missing)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measured_rows()
    TIMELINES.update(gradient_timelines(rows, args.timelines))
    worlds = sorted({w for r in rows for w in (r["hosts"], r["hosts"] * r["ranks_per_host"])} - {1})
    codecs = {}
    loaded = calibration.load(args.calibration) if args.calibration else None
    pieces = calibration.load(args.calibration_pieces)
    for world in worlds:
        fitted_codecs = loaded.codecs if loaded else {f: calibration.fit_codec(f, world)[0] for f in FORMATS}
        codecs.update({("tables", f, world): fitted_codecs[f] for f in FORMATS})
        codecs.update({("pieces", f, world): pieces.codecs[f] for f in FORMATS})
    copy = loaded.copy if loaded and loaded.copy else calibration.time_copy()
    print(f"float32 copies through host memory: {copy * 1e9:.3f} ns per element (every core at once)")
    calibrated = codecs, {"tables": copy, "pieces": pieces.copy}
    links = fit_links(rows, calibrated)
    for rate, link in links.items():
        print(f"link {rate}: fitted on its fp32 rows {link.bandwidth * 8 / 1e9:.2f} Gbit/s, "
              f"latency {link.latency * 1e6:.0f} us")
    costs = fit_processor_costs(rows, links, calibrated)
    for (framework, path, *made), (cost, collective) in ((k, v) for k, v in costs.items() if k is not None):
        whose = f"{framework}'s {path}" + (f" ({made[0]})" if made else "")
        print(f"{whose}: fitted on its uncapped rows {cost * 1e9:.2f} ns of processor per element its "
              f"{'ring reduces' if path == '16-bit' else CODES_COST_MEANING}"
              + (f"; {collective * 1e3:g} ms a collective beyond the link's latency" if collective else ""))
    # a host's ranks reach each other over its namespace's loopback: Gloo over the kernel's TCP on the
    # same two cores, as on the uncapped link between hosts (not LOOPBACK's nominal memory rate)
    inside = links["uncapped"]
    out = []
    for r in rows:
        predicted = predict(r, links[r["rate"]], calibrated, costs[processor_key(r)], inside)
        out.append({k: r[k] for k in ("file", "profile", "params", "hosts", "ranks_per_host", "rate", "compression")}
                   | {"measured": r["step_median"], "predicted": predicted, "error": predicted / r["step_median"] - 1,
                      "fitted": fitted(r), "passive": r.get("omp_wait_policy", "").upper() == "PASSIVE"})
    report(out)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)


def report(out):
    print(f"\n{'file':>28} {'profile':>11} {'HxL':>4} {'rate':>8} {'compression':>14} {'meas s':>7} {'pred s':>7} "
          f"{'error':>6}")
    for o in out:
        print(f"{o['file']:>28} {o['profile']:>11} {o['hosts']}x{o['ranks_per_host']} {o['rate']:>8} "
              f"{o['compression']:>14} {o['measured']:7.3f} {o['predicted']:7.3f} {o['error']:+6.0%}"
              f"{'  (fitted)' if o['fitted'] else ''}")
    print()
    for title, rows in (("every row", out), ("rows run with OpenMP's passive wait", [o for o in out if o["passive"]])):
        if rows:
            print(f"{title}: {summary(rows)}")
    print(f"the measurements' own spread: {spread(out)}")


def summary(out):
    """Predicted rows' errors, and the pairs of paths in one invocation the model orders as measured."""
    errors = sorted(abs(o["error"]) for o in out if not o["fitted"])
    agree, pairs = 0, 0
    for _, group in itertools.groupby(sorted(out, key=_setting), key=_setting):
        for a, b in itertools.combinations(list(group), 2):
            if abs(a["measured"] / b["measured"] - 1) > 0.05:  # closer than the runs' spread: no order to check
                pairs += 1
                agree += (a["measured"] < b["measured"]) == (a["predicted"] < b["predicted"])
    return (f"{len(errors)} predicted rows, median absolute error {statistics.median(errors):.1%}, "
            f"90th percentile {errors[int(0.9 * (len(errors) - 1))]:.0%}, worst {errors[-1]:.0%}, "
            f"within 25 %: {sum(e <= 0.25 for e in errors)}/{len(errors)}; pairs of paths ordered as measured "
            f"(where they differ by > 5 %): {agree}/{pairs}")


def spread(out):
    """How far each invocation of a setting measured in several (one profile and size, hosts, ranks
    a host, link and compression, in any file) lies from those invocations' median step: what the rows
    themselves would miss a perfect model by. The invocations ran on different days and, some,
    on different trees, so this bounds the machine's own spread from above."""
    steps = {}
    for o in out:
        steps.setdefault(_setting(o)[1:] + (o["params"], o["compression"]), []).append(o["measured"])
    off = sorted(abs(m / statistics.median(ms) - 1) for ms in steps.values() if len(ms) > 1 for m in ms)
    return (f"{len(off)} rows of {sum(len(ms) > 1 for ms in steps.values())} settings measured more than once, "
            f"each from its setting's median: median {statistics.median(off):.1%}, 90th percentile "
            f"{off[int(0.9 * (len(off) - 1))]:.0%}, past 25 %: {sum(d > 0.25 for d in off)}")


def _setting(o):
    return o["file"], o["profile"], o["hosts"], o["ranks_per_host"], o["rate"]


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for rate, marker, color in (("1gbit", "o", "C0"), ("10gbit", "s", "C1"), ("uncapped", "^", "C2")):
        for fitted in (False, True):
            pts = [o for o in out if o["rate"] == rate and o["fitted"] == fitted]
            if pts:
                ax.scatter([o["measured"] for o in pts], [o["predicted"] for o in pts], marker=marker, s=18,
                           facecolors="none" if fitted else color, edgecolors=color,
                           label=f"{rate}{', fitted (fp32; 16-bit and codes uncapped)' if fitted else ''}")
    lim = [min(o["measured"] for o in out) * 0.8, max(o["measured"] for o in out) * 1.2]
    ax.plot(lim, lim, "k-", lw=0.7)
    ax.plot(lim, [x * 1.25 for x in lim], "k:", lw=0.5)
    ax.plot(lim, [x * 0.75 for x in lim], "k:", lw=0.5)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="measured step, s", ylabel="predicted step, s",
           title="hvd_aps.perf against the netns cluster")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
