"""The synthetic benchmarks' PyTorch models, one per tensor profile (--profile), one training step
on them, and the compute-only times of its phases.

mlp: four Linear(hidden, hidden) layers (--hidden 2048: 16.8M parameters in 4 large tensors);
large: two 8M-parameter Linear layers (2048 -> 4096 -> 2048, 16.8M parameters), few and large;
resnet50: ResNet-50's 161 parameter tensors (25.6M parameters: 53 convolutions, 53 BatchNorm
weight and bias pairs, the classifier), most of them small, so per-tensor costs show. Its
compute is an elementwise product of every parameter with a fixed tensor of its shape (what a
step costs is then the exchange's, not ResNet's convolutions).
"""
import statistics
import time

import torch
import torch.nn.functional as F

RESNET50_STAGES = [(64, 3), (128, 4), (256, 6), (512, 3)]  # bottleneck width, blocks
EXPANSION = 4


def resnet50_shapes():
    """Shapes of ResNet-50's parameters in torchvision's order."""
    shapes, channels = [(64, 3, 7, 7), (64,), (64,)], 64
    for width, blocks in RESNET50_STAGES:
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (width * EXPANSION, width, 1, 1), (width * EXPANSION,), (width * EXPANSION,)]
            if block == 0:  # the projection shortcut
                shapes += [(width * EXPANSION, channels, 1, 1), (width * EXPANSION,), (width * EXPANSION,)]
            channels = width * EXPANSION
    return shapes + [(1000, channels), (1000,)]


class Shaped(torch.nn.Module):
    """Parameters of the given shapes; forward(x) = x[:, :1] * sum_i <p_i, c_i> for fixed c_i, so
    backward gives every parameter a dense gradient, last ones first."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes])
        for i, s in enumerate(shapes):
            self.register_buffer(f"c{i}", torch.randn(s))

    def forward(self, x):
        return x[:, :1] * sum((p * getattr(self, f"c{i}")).sum() for i, p in enumerate(self.ps))


def model(profile, hidden):
    """(model, input width, output width)."""
    if profile == "mlp":
        return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())]), \
            hidden, hidden
    if profile == "large":
        return torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)), 2048, 2048
    return Shaped(resnet50_shapes()), 1, 1


def step_fn(model, opt, x, y):
    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return step


def phases(model, opt, x, y, repeats=3):
    """Median seconds of forward, backward and the optimizer step, without communication."""
    times = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(repeats):
        opt.zero_grad()
        start = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        opt.step()
        times["forward"].append(mid - start)
        times["backward"].append(end - mid)
        times["optimizer"].append(time.perf_counter() - end)
    return {k: statistics.median(v) for k, v in times.items()}


def prepared(args):
    """(model, optimizer, x, y, parameter count, compute-only phase seconds), seeded alike on
    every rank, one thread per rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, width_in, width_out = model(args.profile, args.hidden)
    x, y = torch.randn(args.batch_size, width_in), torch.randn(args.batch_size, width_out)
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    return net, opt, x, y, sum(p.numel() for p in net.parameters()), phases(net, opt, x, y)
