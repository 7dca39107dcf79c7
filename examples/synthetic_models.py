"""The benchmarks' PyTorch models, one per profile (--profile), one training step on them, and the
compute-only times of its phases.

Real compute (what a step costs includes the model's own work, and gradients become ready while
backward still runs, so the exchange competes with it for the cores):
  resnet18: ResNet-18 written in torch.nn (convolutions, BatchNorm, 11.7M parameters in 62
    tensors), on --image-size square images (default 112), batch --batch-size;
  transformer: --blocks of the accuracy study's pre-norm causal transformer blocks, width
    --hidden (512: 3.1M parameters a block), sequences of 128, batch --batch-size;
  lm: a language model dominated by two huge tensors: a token embedding and an untied LM head of
    --vocab x --hidden (16384 x 512: 8.4M parameters each) around --blocks transformer blocks,
    cross-entropy over sequences of 128 tokens.
Communication-bound (little compute):
  mlp: four Linear(hidden, hidden) layers (--hidden 2048: 16.8M parameters in 4 large tensors);
  large: two 8.4M-parameter Linear layers (2048 -> 4096 -> 2048), a few huge tensors;
  resnet50: ResNet-50's 161 parameter tensors (25.6M parameters), most of them small, so
    per-tensor costs show; its compute is an elementwise product of every parameter with a fixed
    tensor of its shape, so every gradient is ready at once;
  tensors: --tensors vectors of --tensor-elements each (default 300 x 20000: 6M parameters, as
    many tensors as a ResNet-50 or a BERT has), with resnet50's compute: what the exchange costs
    per tensor shows against the same elements in fewer tensors.
No weights or data are downloaded: inputs are random, seeded alike on every rank.
"""
import statistics
import time

import torch
import torch.nn.functional as F

from study_tasks import Block  # the accuracy study's pre-norm causal transformer block

SEQUENCE, HEADS = 128, 8  # the transformer profile's tokens per sequence, attention heads

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
    """Parameters of the given shapes; forward(x) = x[:, :1] * sum_i <p_i, c_i> / sqrt(n) for fixed
    c_i and n parameters, so backward gives every parameter a dense gradient, last ones first. The
    1 / sqrt(n) keeps SGD on it stable (without it a step moves the output by about n * lr, and
    millions of parameters diverge to NaN within a few hundred steps). The c_i are plain tensors,
    not buffers: DDP would broadcast buffers from rank 0 before every forward, as many bytes as the
    gradients again."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes])
        self.fixed = [torch.randn(s) for s in shapes]
        self.scale = sum(p.numel() for p in self.ps) ** -0.5

    def forward(self, x):
        return x[:, :1] * (self.scale * sum((p * c).sum() for p, c in zip(self.ps, self.fixed)))


class BasicBlock(torch.nn.Module):
    """ResNet's two 3x3 convolutions with BatchNorm and a shortcut (a 1x1 projection where the
    shape changes)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(torch.nn.Module):
    """ResNet-18; `width` the first stage's channels (64; the smoke runs' stand-ins take fewer)."""

    def __init__(self, classes=1000, width=64):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, width, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(width),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(8 * width, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Transformer(torch.nn.Module):
    def __init__(self, width, blocks):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(width, HEADS, SEQUENCE) for _ in range(blocks)])
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.ln(self.blocks(x))


class LanguageModel(Transformer):
    """Token embedding, transformer blocks, an untied LM head: most parameters in two tensors."""

    def __init__(self, vocab, width, blocks):
        super().__init__(width, blocks)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        return self.head(super().forward(self.embed(tokens)))


class CausalBlock(torch.nn.Module):
    """GPT-2's block: pre-LayerNorm causal self-attention through torch's fused
    scaled_dot_product_attention (as transformers' GPT-2 runs it with its sdpa attention, so a step
    costs about what a real GPT-2 step does), then a tanh-GELU MLP. No mask buffer: DDP would
    broadcast it."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.reshape(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(width, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """GPT-2's shape without its weights: token and position embeddings, `layers` CausalBlocks, a
    final LayerNorm and the LM head tied to the token embedding (GPT-2 small: vocab 50257, width
    768, 12 heads, 12 layers, 1024 positions: 124M parameters)."""

    def __init__(self, vocab, width, heads, layers, positions):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.Sequential(*[CausalBlock(width, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[-1], device=tokens.device))
        return F.linear(self.ln(self.blocks(x)), self.embed.weight)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model(profile, args):
    """(model, input shape after the batch, output shape after the batch)."""
    hidden = args.hidden
    if profile == "mlp":
        return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(hidden, hidden), torch.nn.ReLU())]), \
            (hidden,), (hidden,)
    if profile == "large":
        return torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)), \
            (2048,), (2048,)
    if profile == "resnet18":
        return ResNet18(), (3, args.image_size, args.image_size), (1000,)
    if profile == "transformer":
        return Transformer(hidden, args.blocks), (SEQUENCE, hidden), (SEQUENCE, hidden)
    if profile == "lm":
        return LanguageModel(args.vocab, hidden, args.blocks), (SEQUENCE,), (SEQUENCE,)
    if profile == "tensors":
        return Shaped([(args.tensor_elements,)] * args.tensors), (1,), (1,)
    return Shaped(resnet50_shapes()), (1,), (1,)


def loss_fn(x):
    """The profile's loss: cross-entropy over tokens for the language model, else mean squares."""
    return lm_loss if x.dtype == torch.long else F.mse_loss


def step_fn(model, opt, x, y):
    loss = loss_fn(x)

    def step():
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return step


PHASE_WARMUP, PHASE_REPEATS = 2, 9  # untimed steps first (allocations, first calls), then the timed ones


def phases(model, opt, x, y, warmup=PHASE_WARMUP, repeats=PHASE_REPEATS):
    """Median seconds of forward, backward and the optimizer step, without communication, after
    `warmup` untimed steps: the compute the performance model is given, so the first steps
    (allocations, first calls) are left out and the median of several kept, which shared cores
    move far less than a few steps counting the first."""
    times, loss_of, untimed = {"forward": [], "backward": [], "optimizer": []}, loss_fn(x), step_fn(model, opt, x, y)
    for _ in range(warmup):
        untimed()
    for _ in range(repeats):
        opt.zero_grad()
        start = time.perf_counter()
        loss = loss_of(model(x), y)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        opt.step()
        times["forward"].append(mid - start)
        times["backward"].append(end - mid)
        times["optimizer"].append(time.perf_counter() - end)
    return {k: statistics.median(v) for k, v in times.items()}


def inputs(args, shape_in, shape_out):
    """Random inputs and targets (token ids for the language model)."""
    if args.profile == "lm":
        return (torch.randint(args.vocab, (args.batch_size, *shape_in)),
                torch.randint(args.vocab, (args.batch_size, *shape_out)))
    return torch.randn(args.batch_size, *shape_in), torch.randn(args.batch_size, *shape_out)


def prepared(args):
    """(model, optimizer, x, y, parameter count, compute-only phase seconds), seeded alike on
    every rank, with --threads intra-op threads per rank (default: the framework's own choice)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net, shape_in, shape_out = model(args.profile, args)
    x, y = inputs(args, shape_in, shape_out)
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    return net, opt, x, y, sum(p.numel() for p in net.parameters()), phases(net, opt, x, y)
