"""Data-parallel benchmark in the style of Horovod's pytorch_synthetic_benchmark.py: --profile
resnet18 or transformer (real compute), mlp, large or resnet50 (communication-bound); see
synthetic_models.py.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py --compression aps-e4m3

--compression (examples/recipes.py): none | fp16 (Horovod's own) | an hvd_aps recipe such as
aps-e4m3 (APSCompressor on horovod.torch.DistributedOptimizer, codes on the wire), aps-e4m3-values,
aps-e4m3-auto (policy="auto") | codes-<rest> (the recipe aps-<rest> through
hvd_aps.torch.DistributedOptimizer). Horovod starts with a plain hvd.init(), as users write it
(--dynamic-process-sets: hvd.init(process_sets="dynamic"), whose process sets the two-level
exchange then uses). Rank 0 prints one JSON line:
median step time, this job's per-rank bytes sent on --iface during the timed steps (from the
interface counters), the compute-only phase times, the codec throughput and the schedule chosen.
"""
import argparse

import horovod.torch as hvd

import hvd_aps
import hvd_aps.torch
import recipes
from benchmark_common import add_arguments, compressor_options, measure
from synthetic_models import prepared, step_fn


def wrap(opt, model, name, options):
    """(the wrapped optimizer, its APSCompressor or None)."""
    comp = recipes.compression(name, hvd.Compression, **options)
    if recipes.uses_codes_optimizer(name):
        opt = hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    return opt, comp if isinstance(comp, hvd_aps.APSCompressor) else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    hvd.init(process_sets="dynamic") if args.dynamic_process_sets else hvd.init()
    model, opt, x, y, params, phases = prepared(args)
    opt, comp = wrap(opt, model, args.compression, compressor_options(args))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    measure(step_fn(model, opt, x, y), args, phases, params, hvd.allgather_object, hvd.rank(), hvd.size(), comp)


if __name__ == "__main__":
    main()
