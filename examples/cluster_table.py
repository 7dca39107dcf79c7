"""Markdown summary tables of examples/netns_cluster.py's JSON rows, as docs/benchmarks.md shows them:
one row per (profile, hosts, link), per framework the codes path with default settings and with
policy="auto", each as x none / x best (the faster of that framework's fp32 and 16-bit runs),
and what policy="auto" settled on.

    python examples/cluster_table.py docs/cluster/schedule_mlp.json docs/cluster/schedule_resnet18.json ...
    python examples/cluster_table.py --fsdp docs/cluster/fsdp_transformer.json ...
"""
import argparse
import json

FRAMEWORKS = (("Horovod", ""), ("DDP", "ddp:"))
LINKS = ("1gbit", "10gbit", "uncapped")  # table order


def ratio(row, key):
    return "-" if row is None or row.get(key) is None else f"{row[key]:.2f}"


def settled(row):
    """What policy="auto" chose, from the bytes it sent (the schedule shown is the last run's)."""
    if row is None:
        return "-"
    return "native" if row["bytes_ratio"] > 0.5 else "codes"


def schedule_table(rows, fmt):
    print("| profile | hosts | link | " + " | ".join(
        f"{name} {fmt} x none / x best | {name} auto x none / x best (chose)" for name, _ in FRAMEWORKS) + " |")
    print("| --- | --- | --- |" + " --- | --- |" * len(FRAMEWORKS))
    shapes = sorted({(r["profile"], r["hosts"], r["rate"]) for r in rows},
                    key=lambda s: (s[0], s[1], LINKS.index(s[2])))
    for profile, hosts, rate in shapes:
        got = {r["compression"]: r for r in rows if (r["profile"], r["hosts"], r["rate"]) == (profile, hosts, rate)}
        cells = []
        for _, prefix in FRAMEWORKS:
            codes, auto = got.get(f"{prefix}aps-{fmt}"), got.get(f"{prefix}aps-{fmt}-auto")
            cells += [f"{ratio(codes, 'step_ratio')} / {ratio(codes, 'best_ratio')}",
                      f"{ratio(auto, 'step_ratio')} / {ratio(auto, 'best_ratio')} ({settled(auto)})"]
        print(f"| {profile} | {hosts} | {rate} | " + " | ".join(cells) + " |")


def fsdp_table(rows):
    """FSDP2: step and bytes against fsdp:none, the reduce-scatter's share of the bytes apart (a
    codes row's own count; none's is the interface's bytes minus the all-gathers', which are the
    same in every row of a shape: the codes row's interface bytes minus its codes)."""
    print("| hosts | link | reshard | compression | step s | x none | MB/step | x none | reduce-scatter MB | x none |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = sorted(rows, key=lambda r: (not r["reshard"], r["hosts"], LINKS.index(r["rate"])))
    for r in rows:
        shape = [q for q in rows if (q["hosts"], q["rate"], q["reshard"]) == (r["hosts"], r["rate"], r["reshard"])]
        coded = [q for q in shape if q.get("codes_bytes_per_step")]
        gathers = min(q["tx_bytes_per_step"] - q["codes_bytes_per_step"] for q in coded) if coded else None
        scatter = r["codes_bytes_per_step"] if r.get("codes_bytes_per_step") else (
            r["tx_bytes_per_step"] - gathers if gathers is not None else None)
        none = next(q for q in shape if q["compression"] == "fsdp:none")
        none_scatter = none["tx_bytes_per_step"] - gathers if gathers is not None else None
        print(f"| {r['hosts']} | {r['rate']} | {'on' if r['reshard'] else 'off'} | {r['compression']} | "
              f"{r['step_median']:.3f} | {r['step_ratio']:.2f} | {r['tx_bytes_per_step'] / 1e6:.1f} | "
              f"{r['bytes_ratio']:.3f} | {scatter / 1e6:.1f} | {scatter / none_scatter:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", help="netns_cluster.py --json files")
    parser.add_argument("--format", default="e4m3", help="the recipes' format: aps-<format>, aps-<format>-auto")
    parser.add_argument("--fsdp", action="store_true", help="the FSDP2 table (rows of fsdp: compressions)")
    args = parser.parse_args()
    rows = [r for path in args.rows for r in json.load(open(path))]
    if args.fsdp:
        fsdp_table(rows)
    else:
        schedule_table(rows, args.format)


if __name__ == "__main__":
    main()
