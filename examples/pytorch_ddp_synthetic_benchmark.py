"""Benchmark for torch.distributed DistributedDataParallel, twin of pytorch_synthetic_benchmark.py:
the same profiles, DDP over Gloo with a communication hook.

    torchrun --nproc-per-node 2 examples/pytorch_ddp_synthetic_benchmark.py --compression aps-e4m3

--compression: none (DDP's allreduce) | fp16 | bf16 (torch's fp16_compress_hook / bf16_compress_hook)
| an hvd_aps recipe (hvd_aps.ddp.aps_hook). Rank 0 prints one JSON line, as the Horovod benchmark does.
"""
import argparse

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmark_common import add_arguments, compressor_options, measure
from pytorch_ddp_digits import register
from synthetic_models import prepared, step_fn


def allgather_object(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    model, opt, x, y, params, phases = prepared(args)
    ddp = DDP(model)
    comp = register(ddp, args.compression, **compressor_options(args))
    measure(step_fn(ddp, opt, x, y), args, phases, params, allgather_object, dist.get_rank(), dist.get_world_size(),
            comp)
    dist.barrier()  # a rank tearing Gloo down while another still talks can abort ("terminate called")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
