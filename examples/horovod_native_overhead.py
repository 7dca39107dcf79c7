"""What Horovod's optimizer step costs once policy="auto" settled on the framework's own allreduce
(the compressor pinned native), against Horovod's own Compression.none, with forward, backward
(the allreduces start there) and the optimizer's step (synchronize waits there) timed apart,
and the seconds a step spends inside the compression's compress() and decompress(), which the
step's own noise cannot hide (Horovod's Compression.none timed by the same wrapper).
One variant a job: Horovod's optimizer hooks every gradient once, so a job cannot switch. Rank 0
prints one JSON line; alternate the variants' jobs, in both orders, to compare them:

    for order in "none native" "native none" "none native" "native none"; do for v in $order; do
      horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_native_overhead.py --variant $v \
          --profile resnet18 --image-size 224 --batch-size 2; done; done
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--variant", choices=VARIANTS, default="native")
    parser.add_argument("--steps", type=int, default=16, help="timed steps, after the warm-up")
    args = parser.parse_args()
    hvd.init()
    model, opt, x, y, _, _ = prepared(args)
    timed = Timed(compression(args.variant))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=timed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_of = loss_fn(x)
    times = {"forward": [], "backward": [], "optimizer": [], "step": [], "compression": []}
    for k in range(WARMUP_STEPS + args.steps):
        timed.seconds = 0.0
        started = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        ended = time.perf_counter()
        if k >= WARMUP_STEPS:
            for key, seconds in (("forward", forward - started), ("backward", backward - forward),
                                 ("optimizer", ended - backward), ("step", ended - started),
                                 ("compression", timed.seconds)):
                times[key].append(seconds)
    if hvd.rank() == 0:
        print(json.dumps({"variant": args.variant, **{k: statistics.median(v) for k, v in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
