"""Synthetic data-parallel benchmark in the style of Horovod's pytorch_synthetic_benchmark.py, on a
communication-bound model: --profile mlp (4 x hidden^2 parameters, little compute), large (two 8M
layers) or resnet50 (ResNet-50's 161 tensors); see synthetic_models.py.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py --compression aps-e4m3

--compression: none | fp16 (Horovod's own) | aps-<fmt> (the card's line: APSCompressor on Horovod's
optimizer, codes on the wire) | aps-<fmt>-values (the same rounding, float16 values on the wire) |
codes-<fmt> (hvd_aps.torch.DistributedOptimizer, codes in buckets fixed at construction).
Rank 0 prints one JSON line: median step time, this job's per-rank bytes sent on --iface during the
timed steps (from the interface counters), the compute-only phase times and the codec throughput
that the performance model in examples/netns_cluster.py uses.
"""
import argparse

import horovod.torch as hvd

import hvd_aps
import hvd_aps.torch
from benchmark_common import add_arguments, compressor_options, measure
from hvd_aps import from_name
from synthetic_models import prepared, step_fn


def wrap(opt, model, compression, options):
    comp = from_name(compression, hvd.Compression, **options)
    if compression.startswith("codes-"):
        return hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    hvd.init()
    model, opt, x, y, params, phases = prepared(args)
    opt = wrap(opt, model, args.compression, compressor_options(args))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    measure(step_fn(model, opt, x, y), args, phases, params, hvd.allgather_object, hvd.rank(), hvd.size())


if __name__ == "__main__":
    main()
