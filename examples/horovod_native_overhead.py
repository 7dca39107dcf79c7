"""What Horovod's optimizer step costs once policy="auto" settled on the framework's own allreduce,
against Horovod's own Compression.none, with forward, backward (the allreduces start there) and
the optimizer's step (synchronize waits there) timed apart, and the seconds a step spends inside
the compression's compress() and decompress(), which the step's own noise cannot hide (Horovod's
Compression.none timed by the same wrapper). Variants: `none`; `native`, the compressor pinned to
Horovod's allreduce; `settled`, the compressor stepped through its trials until it decided (on
loopback give it a link, e.g. HVD_APS_LINK=5gbit, or it may settle on codes: the line printed
says which). Horovod's optimizer hooks every gradient once, so a model cannot switch; several
variants get a model each (seeded alike) and an optimizer each in one job, their steps
alternated, so the machine's speed, which moves between jobs by more than the compressor costs,
moves all alike. Rank 0 prints a JSON line a variant, and each one's ratio to the first:

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_native_overhead.py \
        --variants none,native,settled --profile resnet18 --image-size 224 --batch-size 2 --steps 100
"""
import argparse
import json
import statistics
import time

import horovod.torch as hvd

import hvd_aps
from benchmark_common import add_arguments, settle
from synthetic_models import loss_fn, prepared

VARIANTS = ("none", "native", "settled")
WARMUP_STEPS = 10


def compression(variant: str):
    """Horovod's Compression.none, or an APSCompressor with policy="auto" (`native`: pinned to
    Horovod's allreduce, as if its trials had settled there)."""
    if variant == "none":
        return hvd.Compression.none
    compressor = hvd_aps.APSCompressor("e4m3", policy="auto")
    if variant == "native":
        compressor.pin({"policy": "native"})
    return compressor


class Timed:
    """A compression whose compress() and decompress() add their seconds to `seconds`."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def compress(self, tensor):
        started = time.perf_counter()
        try:
            return self.inner.compress(tensor)
        finally:
            self.seconds += time.perf_counter() - started

    def decompress(self, tensor, ctx):
        started = time.perf_counter()
        try:
            return self.inner.decompress(tensor, ctx)
        finally:
            self.seconds += time.perf_counter() - started


class Variant:
    """One model with its own Horovod optimizer, its parameters' names prefixed with the variant's
    (the optimizers of one job reduce apart), its times a phase, and what its policy chose."""

    def __init__(self, variant: str, args):
        self.name = variant
        self.model, opt, self.x, self.y, _, _ = prepared(args)
        self.timed = Timed(compression(variant))
        named = [(f"{variant}.{n}", p) for n, p in self.model.named_parameters()]
        self.opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=self.timed)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.loss_of = loss_fn(self.x)
        self.times = {"forward": [], "backward": [], "optimizer": [], "step": [], "compression": []}
        self.chosen = None

    def step(self, timed: bool) -> None:
        self.timed.seconds = 0.0
        started = time.perf_counter()
        self.opt.zero_grad()
        loss = self.loss_of(self.model(self.x), self.y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.opt.step()
        ended = time.perf_counter()
        if timed:
            for key, seconds in (("forward", forward - started), ("backward", backward - forward),
                                 ("optimizer", ended - backward), ("step", ended - started),
                                 ("compression", self.timed.seconds)):
                self.times[key].append(seconds)

    def settle(self) -> None:
        """Step until the compressor's policy decided on every rank (at once for the others)."""
        compressor = self.timed.inner if isinstance(self.timed.inner, hvd_aps.APSCompressor) else None
        settle(lambda: self.step(timed=False), compressor, hvd.allgather_object)
        report = compressor.schedule_report() if compressor is not None else []
        self.chosen = report[-1]["chosen"] if report else None

    def medians(self) -> dict:
        return {k: statistics.median(v) for k, v in self.times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--variants", default="native",
                        help=f"comma-separated, of {', '.join(VARIANTS)}: several run in one job, a model each")
    parser.add_argument("--steps", type=int, default=16, help="timed steps a variant, after the warm-up")
    args = parser.parse_args()
    names = args.variants.split(",")
    if set(names) - set(VARIANTS):
        parser.error(f"--variants takes {', '.join(VARIANTS)}, got {args.variants}")
    hvd.init()
    variants = [Variant(v, args) for v in names]
    for v in variants:
        v.settle()
    for k in range(WARMUP_STEPS + args.steps):
        # in rounds alternately in each order, so no variant always follows another
        for v in variants if k % 2 == 0 else variants[::-1]:
            v.step(timed=k >= WARMUP_STEPS)
    if hvd.rank() == 0:
        first = variants[0].times["step"]
        for v in variants:
            ratios = {"x first": statistics.median(v.times["step"]) / statistics.median(first),
                      "pairs' median ratio": statistics.median(b / a for a, b in zip(first, v.times["step"]))}
            print(json.dumps({"variant": v.name, "chosen": v.chosen, **v.medians(), **ratios}), flush=True)


if __name__ == "__main__":
    main()
