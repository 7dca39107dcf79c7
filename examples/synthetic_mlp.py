"""The synthetic benchmarks' PyTorch model: an MLP of --hidden width (4 x hidden^2 parameters,
little compute), and one training step on it."""
import torch
import torch.nn.functional as F


def mlp(hidden):
    return torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())])


def step_fn(model, opt, x, y):
    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return step
