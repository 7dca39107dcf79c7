"""What the PyTorch digits examples share: the data (scikit-learn's digits, shipped with it:
nothing is downloaded), the CNN, the training loop with its progress lines, and the command line."""
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


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


def add_arguments(parser, compression="aps-e4m3"):
    parser.add_argument("--compression", default=compression)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)


def train(model, opt, train_set, test_set, args, rank, average):
    """args.epochs epochs of SGD over this rank's shard; after each, the loss averaged over the
    ranks (`average`: the framework's allreduce of one float) and, on rank 0, a progress line."""
    (x, y), (x_test, y_test) = train_set, test_set
    plain = getattr(model, "module", model)  # DDP wraps the model
    gen = torch.Generator().manual_seed(args.seed + rank)
    steps, start = len(x) // args.batch_size, time.time()
    for epoch in range(1, args.epochs + 1):
        order, total = torch.randperm(len(x), generator=gen), 0.0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        mean_loss = average(total / steps)
        if rank == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {accuracy(plain, x_test, y_test):.4f}  ({time.time() - start:.1f} s)", flush=True)
    if rank == 0:
        print(f"final test accuracy {accuracy(plain, x_test, y_test):.4f}")
