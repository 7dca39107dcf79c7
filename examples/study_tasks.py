"""The accuracy study's two tasks: what each trains, on what data, with which optimizer.

digits: an MLP on scikit-learn's digits (ships with scikit-learn), SGD with momentum; the loss is
scaled by 2**-4 (see accuracy_study.py) so gradient entries are as small as large models' are.
transformer: a 2-layer byte-level transformer language model (token and position embeddings,
causal self-attention, LayerNorm, GELU MLP) trained with AdamW on the Python standard library's
own source files, read at run time: every machine with Python has them, nothing is downloaded.
Adam divides each entry by its own running RMS, so an entry a format flushes to zero is lost
however small it is, and LayerNorm shapes the gradients of every layer: statistics the SGD MLP
does not have.

Every model is written with plain tensor ops so torch.func.vmap can take per-worker gradients for
the emulated runs (shard_grads). DigitsCNN, the digits task through a small CNN, is the
convolutional model of the at-scale examples (fidelity_at_scale.py, training_at_scale.py).
"""
import dataclasses
import math
import pathlib
import sysconfig

import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Task:
    name: str
    global_batch: int  # samples per step over all workers; every worker count must divide it
    steps: int
    lr: float
    loss_scale: float

    def loss(self, model, x, y):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model, x, y):
        """(accuracy, mean loss) of model on (x, y)."""
        with torch.no_grad():
            logits = model(x)
            return ((logits.argmax(-1) == y).float().mean().item(),
                    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())


class Digits(Task):
    def __init__(self):
        super().__init__("digits", global_batch=256, steps=400, lr=0.05, loss_scale=2.0 ** -4)

    def data(self):
        """(train x, train y), (test x, test y); the same split on every rank."""
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(0).permutation(len(x))
        x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
        return (x[360:], y[360:]), (x[:360], y[:360])

    def batch(self, train, gen):
        x, y = train
        idx = torch.randint(len(x), (self.global_batch,), generator=gen)
        return x[idx], y[idx]

    def train_eval_set(self, train):
        return train

    def model(self):
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 10))

    def optimizer(self, params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, width, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        # a constant, not state: out of state_dict (Horovod's broadcast_parameters takes no bool tensors)
        self.register_buffer("future", torch.triu(torch.ones(context, context, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.reshape(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(width, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        attention = scores.masked_fill(self.future[:length, :length], float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class ByteTransformer(torch.nn.Module):
    def __init__(self, vocab=256, width=64, heads=4, layers=2, context=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = torch.nn.Sequential(*[Block(width, heads, context) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[:tokens.shape[-1]]
        return self.head(self.ln(self.blocks(x)))


class StdlibText(Task):
    """Next-byte prediction on the standard library's .py files (sorted, concatenated, the first
    TEXT_BYTES bytes): the last tenth held out for the test accuracy."""

    CONTEXT = 64
    TEXT_BYTES = 4 << 20

    def __init__(self):
        super().__init__("transformer", global_batch=64, steps=300, lr=3e-3, loss_scale=1.0)

    def data(self):
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            chunks.append(path.read_bytes())
            total += len(chunks[-1])
            if total >= self.TEXT_BYTES:
                break
        text = torch.tensor(np.frombuffer(b"".join(chunks)[:self.TEXT_BYTES], np.uint8).astype(np.int64))
        cut = len(text) * 9 // 10
        test = self._windows(text[cut:], torch.arange(0, len(text) - cut - self.CONTEXT - 1, 4099)[:256])
        return text[:cut], test

    def _windows(self, text, starts):
        rows = torch.stack([text[s:s + self.CONTEXT + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(self, train, gen):
        starts = torch.randint(len(train) - self.CONTEXT - 1, (self.global_batch,), generator=gen)
        return self._windows(train, starts)

    def train_eval_set(self, train):
        """256 fixed windows of the training text: the final training loss is measured on them."""
        return self._windows(train, torch.arange(0, len(train) - self.CONTEXT - 1, len(train) // 256)[:256])

    def model(self):
        return ByteTransformer(context=self.CONTEXT)

    def optimizer(self, params, lr):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


class TinyCNN(torch.nn.Module):
    """Two 3x3 convolutions (16, 32 channels), a max-pool, two linear layers: 38,282 parameters."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(32 * 4 * 4, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x.reshape(-1, 1, 8, 8))), 2)
        return self.fc2(F.relu(self.fc1(F.relu(self.conv2(x)).flatten(1))))


class DigitsCNN(Digits):
    """The digits task (data, SGD with momentum, loss scale) through TinyCNN: the convolutional model of
    examples/fidelity_at_scale.py and examples/training_at_scale.py."""

    def __init__(self):
        super().__init__()
        self.name = "digits-cnn"

    def model(self):
        return TinyCNN()


def shard_grads(task, model, params, x, y, shards, samples_at_once=128):
    """Each of `shards` contiguous shards' gradient of the task's (scaled) mean loss at `params`
    ({name: tensor}), taken with torch.func.vmap over samples_at_once samples at a time:
    (shards, numel) float32 per tensor, in params' order."""
    def loss(p, xs, ys):
        return task.loss(lambda inputs: torch.func.functional_call(model, p, (inputs,)), xs, ys) * task.loss_scale

    grad = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    xs, ys = x.reshape(shards, -1, *x.shape[1:]), y.reshape(shards, -1, *y.shape[1:])
    out = {name: np.empty((shards, *p.shape), np.float32) for name, p in params.items()}
    chunk = max(1, samples_at_once // xs.shape[1])
    for a in range(0, shards, chunk):
        for name, g in grad(params, xs[a:a + chunk], ys[a:a + chunk]).items():
            out[name][a:a + chunk] = g.numpy()
    return [out[name].reshape(shards, -1) for name in params]


TASKS = {"digits": Digits, "transformer": StdlibText}
