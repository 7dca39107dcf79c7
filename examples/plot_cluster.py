"""The README's figure from examples/netns_cluster.py's rows: median step time against link speed
for the compressions given, one panel per host count.

    python examples/plot_cluster.py docs/cluster/schedule_mlp.json docs/link_speed.png [--compressions none,fp16,aps-e4m3,aps-e4m3-auto]
"""
import argparse
import json

RATE_GBIT = {"1gbit": 1, "10gbit": 10, "uncapped": 100}  # uncapped: drawn at the right edge
LABELS = {"none": "fp32 (Horovod)", "fp16": "fp16 (Horovod)", "aps-e4m3": "APS e4m3 codes",
          "aps-e4m3-auto": "APS e4m3, policy=auto", "aps-e3m0": "APS e3m0 codes (4-bit)"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows")
    parser.add_argument("png")
    parser.add_argument("--compressions", default="none,fp16,aps-e4m3,aps-e4m3-auto")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = json.loads(open(args.rows).read())
    hosts = sorted({r["hosts"] for r in rows})
    fig, axes = plt.subplots(1, len(hosts), figsize=(5.2 * len(hosts), 3.6), squeeze=False)
    for ax, h in zip(axes[0], hosts):
        for c in args.compressions.split(","):
            points = sorted((RATE_GBIT[r["rate"]], r["step_median"]) for r in rows if r["hosts"] == h and r["compression"] == c)
            if points:
                ax.plot(*zip(*points), "o-", label=LABELS.get(c, c))
        profile, params = rows[0]["profile"], rows[0]["params"]
        ax.set(xscale="log", yscale="log", xlabel="link between hosts, Gbit/s (100: uncapped)",
               ylabel="step time, s (median)", title=f"{h} hosts, {profile} ({params / 1e6:.1f}M parameters)")
        ax.set_xticks(sorted(RATE_GBIT.values()), ["1", "10", "uncapped"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
