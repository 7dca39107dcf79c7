"""Accuracy of model parallelism in codes: the accuracy study's byte-level transformer trained with
its layers split into pipeline stages (hvd_aps.pipelining.CodesPipelineStage, 1F1B) or sharded by
tensor parallelism with sequence parallelism (hvd_aps.tensor_parallel's styles), every rank a stage
or a shard, against the same layout in float32 and on bfloat16's grid.

    torchrun --nproc-per-node 2 examples/model_parallel_study.py --layout pipeline
    torchrun --nproc-per-node 2 examples/model_parallel_study.py --layout tensor [--seeds 2] [--steps 300]

Settings: fp32 (torch's own PipelineStage, or ColwiseParallel and RowwiseParallel), bf16 (codes of
e8m7, bfloat16's grid: every boundary's values rounded to bfloat16, and a tensor-parallel sum of
two shards rounded once, as a bfloat16 allreduce of two ranks rounds it), e4m3 (e4m3 both ways),
e4m3/e5m2 (pipeline: e4m3 forward, e5m2 backward), e2m1fn/32 (4-bit, an exponent every 32 values).
The transformer: width 64, 4 heads, 2 blocks, context 64, AdamW (the accuracy study's), its
attention written with q, k and v apart so that a shard holds whole heads. Every rank trains on the
same global batch (a pipeline's micro-batches: 4). Rank 0 prints each setting's final training
loss (mean of the last 20 steps) and held-out loss over its seeds, and x fp32.
"""
import argparse
import math
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hvd_aps
import hvd_aps.pipelining
import hvd_aps.tensor_parallel
from study_tasks import StdlibText

WIDTH, HEADS, LAYERS, CONTEXT, VOCAB = 64, 4, 2, 64, 256  # the accuracy study's transformer
MICROBATCHES, LAST = 4, 20
SETTINGS = ["fp32", "bf16", "e4m3", "e4m3/e5m2", "e2m1fn/32"]


class Attention(torch.nn.Module):
    """Causal multi-head attention with q, k and v apart: sharded by columns, each rank holds
    whole heads, and the heads it holds come from the local width."""

    def __init__(self, width, heads, context):
        super().__init__()
        self.head_width = width // heads
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))
        self.out = torch.nn.Linear(width, width)
        self.register_buffer("future", torch.triu(torch.ones(context, context, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        batch, length = x.shape[:2]
        q, k, v = (t.reshape(batch, length, -1, self.head_width).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_width)
        attention = scores.masked_fill(self.future[:length, :length], float("-inf")).softmax(-1)
        return self.out((attention @ v).transpose(1, 2).reshape(batch, length, -1))


class Block(torch.nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attention = Attention(width, heads, context)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Embedding(torch.nn.Module):
    def __init__(self, width, context):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, tokens):
        return self.embed(tokens) + self.position[:tokens.shape[-1]]


class Head(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, VOCAB)

    def forward(self, x):
        return self.head(self.ln(x))


def pieces(width=WIDTH, heads=HEADS, layers=LAYERS, context=CONTEXT):
    """The model as its pieces in order: the embedding, the blocks, the head."""
    return [Embedding(width, context), *[Block(width, heads, context) for _ in range(layers)], Head(width)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def codes_of(setting):
    """(forward, backward) BlockCodes of a codes setting."""
    formats = setting.split("/")
    if formats[-1].isdigit():
        block = int(formats.pop())
        return tuple(hvd_aps.BlockCodes(f, block) for f in (formats * 2)[:2])
    return tuple(hvd_aps.BlockCodes("e8m7" if f == "bf16" else f) for f in (formats * 2)[:2])


def stage_of(setting, parts, rank, size):
    """(this rank's stage of `parts` cut into `size` stages of about equal count, its module, the
    cut's bounds): torch's PipelineStage for fp32, CodesPipelineStage for codes."""
    from torch.distributed.pipelining import PipelineStage
    bounds = [round(k * len(parts) / size) for k in range(size + 1)]
    module = torch.nn.Sequential(*parts[bounds[rank]:bounds[rank + 1]])
    if setting == "fp32":
        return PipelineStage(module, rank, size, torch.device("cpu")), module, bounds
    forward, backward = codes_of(setting)
    return (hvd_aps.pipelining.CodesPipelineStage(module, rank, size, torch.device("cpu"), forward=forward,
                                                  backward=backward), module, bounds)


def pipeline_run(setting, task, seed, args, rank, size):
    """The pieces cut into `size` stages, 1F1B over MICROBATCHES -> (the last stage's per-step
    losses, the full model's held-out loss on rank 0)."""
    from torch.distributed.pipelining import Schedule1F1B
    torch.manual_seed(seed)
    stage, module, bounds = stage_of(setting, pieces(), rank, size)
    opt = task.optimizer(module.parameters(), task.lr)
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    train, test = task.data()
    gen, losses = torch.Generator().manual_seed(seed), []
    for _ in range(args.steps):
        x, y = task.batch(train, gen)
        opt.zero_grad()
        step_losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == size - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        if step_losses:
            losses.append(torch.stack(step_losses).mean().item())
    states = [None] * size
    dist.all_gather_object(states, module.state_dict())
    held_out = None
    if rank == 0:
        whole = torch.nn.Sequential(*pieces())
        for k, state in enumerate(states):
            torch.nn.Sequential(*whole[bounds[k]:bounds[k + 1]]).load_state_dict(state)
        held_out = task.evaluate(whole, *test)[1]
    return losses, held_out


def tensor_plan(compressor, layers=LAYERS):
    """Sequence parallel, as torchtitan lays it out: the embedding's output cut along the sequence
    (a local slice), every norm on the sequence's shards, each block's q, k, v and up layers
    gathering them, its out and down layers scattering back (DTensors: the residual adds shards),
    the head gathering the sequence and replicating its logits. Left to DTensor in float32: the
    embedding output's gradient (its all-gather) and the norms' parameter gradients (their sums).
    The residual stream stays a DTensor sharded by sequence, so that it adds to the styles' outputs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)
    if compressor is None:
        col, row = ColwiseParallel, RowwiseParallel
    else:
        def col(**kw):
            return hvd_aps.tensor_parallel.CodesColwiseParallel(compressor, **kw)

        def row(**kw):
            return hvd_aps.tensor_parallel.CodesRowwiseParallel(compressor, **kw)
    plan = {"0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                     use_local_output=False),
            f"{layers + 1}.ln": SequenceParallel(),
            f"{layers + 1}.head": col(input_layouts=Shard(1), output_layouts=Replicate())}
    for b in range(1, layers + 1):
        plan.update({f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     **{f"{b}.attention.{n}": col(input_layouts=Shard(1)) for n in ("q", "k", "v")},
                     f"{b}.attention.out": row(output_layouts=Shard(1), use_local_output=False),
                     f"{b}.up": col(input_layouts=Shard(1)),
                     f"{b}.down": row(output_layouts=Shard(1), use_local_output=False)})
    return plan


def tensor_run(setting, task, seed, args, rank, size):
    """The whole model on every rank, its layers sharded by tensor_plan -> (per-step losses,
    held-out loss)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*pieces())
    codes = None if setting == "fp32" else codes_of(setting)[0]
    plan = tensor_plan(None if codes is None else hvd_aps.APSCompressor(codes.fmt))
    for style in plan.values():
        if hasattr(style, "gathered"):  # the all-gathers' blocks as the setting's
            style.gathered = codes
    parallelize_module(model, init_device_mesh("cpu", (size,)), plan)
    opt = task.optimizer(model.parameters(), task.lr)
    train, test = task.data()
    gen, losses = torch.Generator().manual_seed(seed), []
    for _ in range(args.steps):
        x, y = task.batch(train, gen)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, task.evaluate(model, *test)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["pipeline", "tensor"], required=True)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task, run = StdlibText(), pipeline_run if args.layout == "pipeline" else tensor_run
    results = {}
    for setting in args.settings.split(","):
        for seed in range(args.seeds):
            losses, held_out = run(setting, task, seed, args, rank, size)
            results.setdefault(setting, []).append((statistics.mean(losses[-LAST:]) if losses else None, held_out))
    if rank == (size - 1 if args.layout == "pipeline" else 0):
        train_losses = {s: statistics.mean(r[0] for r in runs) for s, runs in results.items()}
        print(f"{args.layout}, {size} ranks, {args.seeds} seeds, {args.steps} steps: final training loss "
              f"(mean of the last {LAST} steps), x fp32")
        for setting, loss in train_losses.items():
            print(f"{setting:>12} {loss:.4f} {loss / train_losses.get('fp32', loss):.4f}")
    if rank == 0:
        print("held-out loss: " + ", ".join(f"{s} {statistics.mean(r[1] for r in runs):.4f}"
                                            for s, runs in results.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
