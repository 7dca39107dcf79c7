"""Data-parallel training of a small CNN on scikit-learn's digits with horovod.torch and APSCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py --compression aps-e4m3

--compression: none | fp16 | aps-<format> (e.g. aps-e4m3, aps-e5m2, aps-e3m0: codes on the wire) |
naive-<format> (the format without APS scaling), with -values appended for float16 values on the
wire, all through horovod.torch.DistributedOptimizer; or codes-<format>:
hvd_aps.torch.DistributedOptimizer, with buckets fixed at construction.
The data ships with scikit-learn: nothing is downloaded.
"""
import argparse

import horovod.torch as hvd
import torch

import hvd_aps
import hvd_aps.torch
from digits_torch import add_arguments, cnn, digits, train
import recipes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size())
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = recipes.compression(args.compression, hvd.Compression)
    if args.compression.startswith("codes-"):
        opt = hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                 compression=compression)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(x)} training images per rank, compression={args.compression}")

    train(model, opt, (x, y), (x_test, y_test), args, hvd.rank(),
          lambda value: hvd.allreduce(torch.tensor(value), name="loss").item())
    if hvd.rank() == 0:
        if isinstance(compression, hvd_aps.APSCompressor):
            print(f"per rank, all {args.epochs} epochs: {compression.totals()}; "
                  f"the codes exchanges sent {compression.bytes_sent} bytes")


if __name__ == "__main__":
    main()
