"""Data-parallel training of a small CNN on scikit-learn's digits with horovod.torch and APSCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py --compression aps-e4m3

--compression: none | fp16 | aps-<format> (e.g. aps-e4m3, aps-e5m2, aps-e3m0: codes on the wire) |
naive-<format> (the format without APS scaling), with -values appended for float16 values on the
wire, all through horovod.torch.DistributedOptimizer; or codes-<format>:
hvd_aps.torch.DistributedOptimizer, with buckets fixed at construction.
The data ships with scikit-learn: nothing is downloaded.
"""
import argparse
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvd_aps
import hvd_aps.torch
from hvd_aps import from_name


def digits(rank, size, test_fraction=0.2, seed=0):
    """This rank's shard of the training split, and the whole test split, as tensors."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y[order])
    n_test = int(len(x) * test_fraction)
    return (x[n_test:][rank::size], y[n_test:][rank::size]), (x[:n_test], y[:n_test])


def cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="aps-e4m3")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    (x, y), (x_test, y_test) = digits(hvd.rank(), hvd.size())
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = from_name(args.compression, hvd.Compression)
    if args.compression.startswith("codes-"):
        opt = hvd_aps.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                 compression=compression)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(x)} training images per rank, compression={args.compression}")

    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    steps = len(x) // args.batch_size
    start = time.time()
    for epoch in range(1, args.epochs + 1):
        order, total = torch.randperm(len(x), generator=gen), 0.0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        mean_loss = hvd.allreduce(torch.tensor(total / steps), name="loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {accuracy(model, x_test, y_test):.4f}  ({time.time() - start:.1f} s)", flush=True)

    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy(model, x_test, y_test):.4f}")
        if isinstance(compression, hvd_aps.APSCompressor):
            print(f"per rank, all {args.epochs} epochs: {compression.totals()}; "
                  f"the codes exchanges sent {compression.bytes_sent} bytes")


if __name__ == "__main__":
    main()
