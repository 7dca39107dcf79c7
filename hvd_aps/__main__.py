"""Command line: `python -m hvd_aps formats` and `python -m hvd_aps probe --format e4m3 --ranks 8`."""
import argparse
import sys

from . import codec, emulate
from .formats import PRESETS, FloatFormat


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


def _format_arg(name):
    try:
        return FloatFormat.parse(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
    probe.set_defaults(run=probe_command)
    args = parser.parse_args(argv)
    if args.command == "probe":
        args.format = args.format or [FloatFormat.parse("e4m3"), FloatFormat.parse("e3m0")]
        if args.ranks < 1 or args.size < 1:
            parser.error("--ranks and --size must be positive")
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
