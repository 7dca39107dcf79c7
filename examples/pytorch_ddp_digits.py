"""Data-parallel training of a small CNN on scikit-learn's digits with torch.distributed DDP and
hvd_aps.ddp.aps_hook (no Horovod needed).

    torchrun --nproc-per-node 2 examples/pytorch_ddp_digits.py --compression aps-e4m3

--compression: none (DDP's allreduce) | fp16 | bf16 (torch's fp16/bf16_compress_hook) | aps-<format>
(hvd_aps.ddp.aps_hook: e.g. aps-e4m3, aps-e5m2, aps-e3m0) | naive-<format> (the format without APS).
The data ships with scikit-learn: nothing is downloaded.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
from digits_torch import add_arguments, cnn, digits, train
import recipes

TORCH_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
               "allreduce": default_hooks.allreduce_hook}


def register(ddp, name, **options):
    """The hook a --compression name stands for (options: further APSCompressor keywords);
    returns the APSCompressor, if any."""
    if name in TORCH_HOOKS:
        ddp.register_comm_hook(None, TORCH_HOOKS[name])
        return None
    if name == "none":
        return None
    compressor = recipes.compression(name, None, **options)
    ddp.register_comm_hook(hvd_aps.ddp.APSState(compressor), hvd_aps.ddp.aps_hook)
    return compressor


def mean_over_ranks(value, size):
    total = torch.tensor([value])
    dist.all_reduce(total)
    return total.item() / size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (x, y), (x_test, y_test) = digits(rank, size)
    model = DDP(cnn())  # DDP broadcasts rank 0's parameters
    compressor = register(model, args.compression)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    if rank == 0:
        print(f"{size} ranks, {len(x)} training images per rank, compression={args.compression}")

    train(model, opt, (x, y), (x_test, y_test), args, rank, lambda value: mean_over_ranks(value, size))
    if rank == 0:
        if compressor is not None:
            print(f"per rank, all {args.epochs} epochs: {compressor.totals()}; "
                  f"the codes exchanges sent {compressor.bytes_sent} bytes")
    dist.barrier()  # no rank tears Gloo down while another still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
