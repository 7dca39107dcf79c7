"""A model whose graph can differ between ranks, and the outcome of a run, for the drop-in
scenarios (dropin_checks.py under Horovod, ddp_dropin_checks.py under torchrun)."""
import numpy as np
import torch

FEATURES, HIDDEN, CLASSES = 20, 100, 10
STEPS = 3
VOCAB = 50  # rows of SparseTable's embedding


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; `both` uses the second head too (on one rank only, where a test
    says so), so that rank's graph holds parameters the other's lacks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(FEATURES, HIDDEN)
        self.first, self.second = torch.nn.Linear(HIDDEN, CLASSES), torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, both):
        h = torch.relu(self.trunk(x))
        y = self.first(h)
        return y + self.second(h) if both else y


class Deeper(TwoHeads):
    """TwoHeads with one more layer on its output: another model, the first gradient of whose
    backward is one a TwoHeads lacks."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(CLASSES, CLASSES)

    def forward(self, x, both):
        return self.extra(super().forward(x, both))


class SparseTable(torch.nn.Module):
    """An embedding with sparse gradients (rows looked up from the inputs), then a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(VOCAB, HIDDEN, sparse=True)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.table((x.abs() * 10).long() % VOCAB).mean(1))


def batch(rank, step):
    """Inputs and labels of its own for every rank and step."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, FEATURES, generator=g), torch.randint(0, CLASSES, (16,), generator=g)


def loss(forward, x, y):
    """Cross entropy of forward(x) against y."""
    return torch.nn.functional.cross_entropy(forward(x), y)


def plain_step(opt, forward, x, y):
    """A step as most scripts take one: zero_grad() (between steps), backward, step()."""
    opt.zero_grad()
    loss(forward, x, y).backward()
    opt.step()


def sgd(model, opt, rank, steps, forward, take_step=plain_step):
    """`steps` SGD steps of cross entropy on `forward(x)`, each `take_step(opt, forward, x, y)`
    -> the model's final parameters, flat."""
    for step in range(steps):
        take_step(opt, forward, *batch(rank, step))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def save_outcome(out, run, fn):
    """out[run] = fn(), or out[run + "_error"] = the error it raised: the tests compare the stock
    run's outcome with the codes run's, errors included."""
    try:
        out[run] = fn()
    except Exception as err:  # the outcome itself
        out[f"{run}_error"] = np.array(f"{type(err).__name__}: {err}")
