"""The synthetic benchmarks' PyTorch model: an MLP of --hidden width (4 x hidden^2 parameters,
little compute), one training step on it, and its compute-only time."""
import statistics

import torch
import torch.nn.functional as F

from benchmark_common import timed


def mlp(hidden):
    return torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())])


def step_fn(model, opt, x, y):
    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return step


def prepared(args):
    """(model, optimizer, x, y, parameter count, median compute-only step seconds), seeded alike
    on every rank, one thread per rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp(args.hidden)
    x, y = torch.randn(args.batch_size, args.hidden), torch.randn(args.batch_size, args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    compute = statistics.median(timed(step_fn(model, opt, x, y), 3))  # no communication yet
    return model, opt, x, y, sum(p.numel() for p in model.parameters()), compute
