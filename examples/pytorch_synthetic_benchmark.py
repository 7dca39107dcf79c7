"""Data-parallel benchmark in the style of Horovod's pytorch_synthetic_benchmark.py: --profile
resnet18 or transformer (real compute), mlp, large or resnet50 (communication-bound); see
synthetic_models.py.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py --compression aps-e4m3

--compression (examples/recipes.py): none | fp16 (Horovod's own) | tokens (Horovod's per-gradient
path alone, no exchange: a floor, not training) | an hvd_aps recipe such as
aps-e4m3 (APSCompressor on horovod.torch.DistributedOptimizer, codes on the wire), aps-e4m3-values,
aps-e4m3-auto (policy="auto") | codes-<rest> (the recipe aps-<rest> through
hvd_aps.torch.DistributedOptimizer); several, comma-separated (none,aps-e4m3): a model and an
optimizer each in one job, their timed steps alternated (benchmark_common.measure_together), a
JSON line each. Horovod starts with a plain hvd.init(), as users write it
(--dynamic-process-sets: hvd.init(process_sets="dynamic"), whose process sets the two-level
exchange then uses). Rank 0 prints a JSON line a compression:
median step time, this job's per-rank bytes sent on --iface during the timed steps (from the
interface counters), the compute-only phase times, the codec throughput and the schedule chosen.
"""
import argparse

import horovod.torch as hvd

import hvd_aps
import hvd_aps.torch
import recipes
from benchmark_common import Variant, add_arguments, compressor_options, measure_together
from synthetic_models import prepared, step_fn


def wrap(opt, named, name, options):
    """(the wrapped optimizer, its APSCompressor or None)."""
    comp = recipes.compression(name, hvd.Compression, **options)
    if recipes.uses_codes_optimizer(name):
        opt = hvd_aps.torch.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    return opt, comp if isinstance(comp, hvd_aps.APSCompressor) else None


def variant(name, args, together):
    """A model (seeded alike on every rank and for every variant) stepping through `name`'s
    optimizer; its parameters' names prefixed with it where `together` (several in one job:
    Horovod reduces each model's tensors apart) -> (Variant, parameters, compute-only phases)."""
    model, opt, x, y, params, phases = prepared(args)
    named = [(f"{name}.{n}" if together else n, p) for n, p in model.named_parameters()]
    opt, comp = wrap(opt, named, name, compressor_options(args))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return Variant(name, step_fn(model, opt, x, y), comp), params, phases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    hvd.init(process_sets="dynamic") if args.dynamic_process_sets else hvd.init()
    names = args.compression.split(",")
    made = [variant(name, args, len(names) > 1) for name in names]
    variants = [v for v, _, _ in made]
    params, phases = made[0][1], made[0][2]
    measure_together(variants, args, phases, params, hvd.allgather_object, hvd.rank(), hvd.size())


if __name__ == "__main__":
    main()
