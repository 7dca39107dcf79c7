"""What Horovod's optimizer step costs once policy="auto" settled on the framework's own allreduce
(the compressor pinned native), against Horovod's own Compression.none, with forward, backward
(the allreduces start there) and the optimizer's step (synchronize waits there) timed apart,
and the seconds a step spends inside the compression's compress() and decompress(), which the
step's own noise cannot hide (Horovod's Compression.none timed by the same wrapper).
Horovod's optimizer hooks every gradient once, so a model cannot switch; `--variant both` gives
each variant a model (seeded alike) and its own optimizer in one job and alternates their steps,
so the machine's speed, which moves between jobs by more than the compressor costs, moves both
alike. Rank 0 prints a JSON line a variant, and with both their ratio:

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_native_overhead.py --variant both \
        --profile resnet18 --image-size 224 --batch-size 2
"""
import argparse
import json
import statistics
import time

import horovod.torch as hvd

import hvd_aps
from benchmark_common import add_arguments
from synthetic_models import loss_fn, prepared

VARIANTS = ("none", "native")
BOTH = "both"
WARMUP_STEPS = 10


def compression(variant: str):
    """Horovod's Compression.none, or an APSCompressor whose policy="auto" settled on native."""
    if variant == "none":
        return hvd.Compression.none
    compressor = hvd_aps.APSCompressor("e4m3", policy="auto")
    compressor.pin({"policy": "native"})  # as if its trials had settled on Horovod's allreduce
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
    (two optimizers in one job reduce apart), and its times a phase."""

    def __init__(self, variant: str, args):
        self.name = variant
        self.model, opt, self.x, self.y, _, _ = prepared(args)
        self.timed = Timed(compression(variant))
        named = [(f"{variant}.{n}", p) for n, p in self.model.named_parameters()]
        self.opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=self.timed)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.loss_of = loss_fn(self.x)
        self.times = {"forward": [], "backward": [], "optimizer": [], "step": [], "compression": []}

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

    def medians(self) -> dict:
        return {k: statistics.median(v) for k, v in self.times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--variant", choices=VARIANTS + (BOTH,), default="native",
                        help=f"{BOTH}: a model for each in one job, their steps alternated")
    parser.add_argument("--steps", type=int, default=16, help="timed steps a variant, after the warm-up")
    args = parser.parse_args()
    hvd.init()
    variants = [Variant(v, args) for v in (VARIANTS if args.variant == BOTH else (args.variant,))]
    for k in range(WARMUP_STEPS + args.steps):
        # in pairs of steps alternately in each order, so neither variant always follows the other
        for v in variants if k % 2 == 0 else variants[::-1]:
            v.step(timed=k >= WARMUP_STEPS)
    if hvd.rank() == 0:
        for v in variants:
            print(json.dumps({"variant": v.name, **v.medians()}), flush=True)
        if len(variants) == 2:
            none, native = (v.times["step"] for v in variants)
            print(json.dumps({"native / none": statistics.median(native) / statistics.median(none),
                              "pairs' median ratio": statistics.median(b / a for a, b in zip(none, native))}),
                  flush=True)


if __name__ == "__main__":
    main()
