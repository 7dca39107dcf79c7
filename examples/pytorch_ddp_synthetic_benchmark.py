"""Synthetic benchmark for torch.distributed DistributedDataParallel, twin of
pytorch_synthetic_benchmark.py: the same MLP, DDP over Gloo with a communication hook.

    torchrun --nproc-per-node 2 examples/pytorch_ddp_synthetic_benchmark.py --compression aps-e4m3

--compression: none (DDP's allreduce) | fp16 | bf16 (torch's fp16_compress_hook / bf16_compress_hook)
| aps-<fmt> (hvd_aps.ddp.aps_hook). Rank 0 prints one JSON line, as the Horovod benchmarks do.
"""
import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
from benchmark_common import add_arguments, measure, timed
from synthetic_mlp import mlp, step_fn

TORCH_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def register(ddp, compression):
    if compression in TORCH_HOOKS:
        ddp.register_comm_hook(None, TORCH_HOOKS[compression])
    elif compression != "none":
        comp = hvd_aps.from_name(compression, None)
        comp.collect_stats = False
        ddp.register_comm_hook(hvd_aps.ddp.APSState(comp), hvd_aps.ddp.aps_hook)


def allgather_object(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp(args.hidden)
    params = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(args.batch_size, args.hidden), torch.randn(args.batch_size, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    compute = statistics.median(timed(step_fn(model, opt, x, y), 3))  # no communication yet
    ddp = DDP(model)
    register(ddp, args.compression)
    measure(step_fn(ddp, opt, x, y), args, compute, params, allgather_object, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
