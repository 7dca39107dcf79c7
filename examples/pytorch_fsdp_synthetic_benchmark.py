"""Benchmark for FSDP2 (torch.distributed.fsdp.fully_shard), twin of the DDP benchmark: every block
of the model its own FSDP unit (the transformer profile's blocks, the MLP's layers), Gloo.

    torchrun --nproc-per-node 2 examples/pytorch_fsdp_synthetic_benchmark.py --profile transformer --compression aps-e4m3

--compression: none (FSDP's own collectives, float32) | fp16 (FSDP's own, the reduce-scatter in
float16: MixedPrecisionPolicy(reduce_dtype=torch.float16), the 16-bit peer) | bf16-params (the
parameters gathered and computed in bfloat16, the gradients reduced in float32:
MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) | bf16 (both in
bfloat16) | an hvd_aps recipe (hvd_aps.fsdp: codes in the reduce-scatter); `+params-<format>` after
any of them gathers the parameters as codes too (hvd_aps.fsdp.apply(params=<format>)), e.g.
aps-e4m3+params-e4m3, none+params-e4m3. --no-reshard keeps the parameters unsharded between forward
and backward (one all-gather a step instead of two). --hsdp shards every block inside a host and replicates it
across hosts: `none` is torch's own HSDP (hvd_aps.fsdp.hsdp_mesh(), float32 all-reduce across
hosts), a recipe hvd_aps.fsdp.host_mesh() with apply(replicate_group=...) (codes across hosts only).
Rank 0 prints one JSON line as the other benchmarks do, with
`codes_bytes_per_step`: what this rank's codes reduce-scatter sent, and `gather_bytes_per_step`:
what its codes all-gathers sent (the rest of the interface's bytes are FSDP's own collectives).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_aps
import hvd_aps.fsdp
import recipes

# the FSDP2 peers: (param_dtype, reduce_dtype) of FSDP's own collectives (None: the parameters' float32)
POLICIES = {"none": (None, None), "fp16": (None, torch.float16), "bf16-params": (torch.bfloat16, torch.float32),
            "bf16": (torch.bfloat16, torch.bfloat16)}
PARAMS = "+params-"  # what follows it: the parameters' codes
from benchmark_common import add_arguments, compressor_options, measure
from synthetic_models import prepared, step_fn


def allgather_object(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def shard(model, reshard, mesh=None, reduce_dtype=None, param_dtype=None):
    """fully_shard every block (its children that hold parameters and run a forward of their own:
    transformer blocks, the MLP's layers; not a ParameterList, whose parameters its parent uses),
    then the root, on `mesh` (None: every rank), computing in `param_dtype` and reducing in
    `reduce_dtype` (None: the parameters' float32)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    options = dict(reshard_after_forward=reshard, mesh=mesh, mp_policy=policy)
    blocks = getattr(model, "blocks", model)
    for child in blocks.children():
        if any(True for _ in child.parameters()) and not isinstance(child, torch.nn.ParameterList):
            fully_shard(child, **options)
    return fully_shard(model, **options)


def meshes(args) -> tuple:
    """(the mesh to shard on, the replicate group for hvd_aps.fsdp.apply) of this run."""
    if not args.hsdp:
        return None, None
    if args.compression.partition(PARAMS)[0] in POLICIES:
        return hvd_aps.fsdp.hsdp_mesh(), None
    return hvd_aps.fsdp.host_mesh()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--hsdp", action="store_true", help="shard inside each host, replicate across hosts")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    model, opt, x, y, params, phases = prepared(args)
    mesh, replicate = meshes(args)
    grads, _, codes = args.compression.partition(PARAMS)
    param_dtype, reduce_dtype = POLICIES.get(grads, (None, None))
    shard(model, not args.no_reshard, mesh, reduce_dtype, param_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # over the sharded parameters
    comp = None if grads in POLICIES else recipes.compression(grads, **compressor_options(args))
    if comp is not None or codes:
        hvd_aps.fsdp.apply(model, comp, replicate_group=replicate, params=codes or None)
    step, steps = step_fn(model, opt, x, y), []

    def counted():
        steps.append(None)
        return step()
    measure(counted, args, phases, params, allgather_object, dist.get_rank(), dist.get_world_size(), comp,
            extra={"reshard": not args.no_reshard, "hsdp": args.hsdp, "params_codes": codes or None,
                   "gather_bytes_per_step": lambda: hvd_aps.fsdp.gather_bytes(model) / max(1, len(steps))})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
