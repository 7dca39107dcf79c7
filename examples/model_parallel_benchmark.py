"""Benchmark for model parallelism in codes, twin of the data-parallel benchmarks: a transformer of
--blocks blocks of width --hidden (8 heads, sequences of --sequence bytes) split into pipeline
stages (one a rank, 1F1B over --microbatches micro-batches of the --batch-size samples) or sharded
by tensor and sequence parallelism (examples/model_parallel_study.py's plan), Gloo.

    torchrun --nproc-per-node 2 examples/model_parallel_benchmark.py --layout pipeline --compression e4m3

--compression: none (torch's PipelineStage, or ColwiseParallel and RowwiseParallel: float32),
bf16 (codes on bfloat16's grid: e8m7, 2 bytes a value), a format (e4m3, e3m2fn, ...: both ways) or
forward/backward formats (e4m3/e5m2), optionally /<block> (e2m1fn/32). Rank 0 prints one JSON line
as the other benchmarks do; its compute is a step's without communication: this rank's stage
alone (pipeline), or the whole model's divided by the ranks (tensor parallel, an estimate).
"""
import argparse
import time

import torch
import torch.distributed as dist

from benchmark_common import add_arguments, measure
from model_parallel_study import loss_fn, pieces, stage_of, tensor_plan
from model_parallel_study import codes_of as study_codes

HEADS, VOCAB = 8, 256
NAMES = {"none": "fp32"}  # this benchmark's compression names -> the study's settings


def allgather_object(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def batch(args):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(VOCAB, (args.batch_size, args.sequence), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def timed_alone(module, inputs, target=None, repeats=5) -> float:
    """Median seconds of a forward and backward of `module` on `inputs` (the loss on `target`, else
    the output's sum), without communication."""
    times = []
    for _ in range(repeats + 1):
        module.zero_grad()
        start = time.perf_counter()
        out = module(inputs)
        (loss_fn(out, target) if target is not None else out.sum()).backward()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def pipeline(args, rank, size):
    from torch.distributed.pipelining import Schedule1F1B
    setting = NAMES.get(args.compression, args.compression)
    torch.manual_seed(0)
    parts = pieces(args.hidden, HEADS, args.blocks, args.sequence)
    stage, module, bounds = stage_of(setting, parts, rank, size)
    opt = torch.optim.SGD(module.parameters(), lr=1e-6)
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    x, y = batch(args)

    def step():
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()

    # this stage's compute on the activations it receives (the embedding's tokens for the first)
    with torch.no_grad():
        h = x
        for part in parts[:bounds[rank]]:
            h = part(h)
    alone = timed_alone(module, h.requires_grad_(h.is_floating_point()), y if rank == size - 1 else None)
    return step, {"step": alone}, sum(p.numel() for p in module.parameters())


def tensor(args, rank, size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    import hvd_aps
    setting = NAMES.get(args.compression, args.compression)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*pieces(args.hidden, HEADS, args.blocks, args.sequence))
    x, y = batch(args)
    alone = timed_alone(model, x, y) / size
    params = sum(p.numel() for p in model.parameters())
    codes = None if setting == "fp32" else study_codes(setting)[0]
    plan = tensor_plan(None if codes is None else hvd_aps.APSCompressor(codes.fmt), args.blocks)
    for style in plan.values():
        if hasattr(style, "gathered"):
            style.gathered = codes
    parallelize_module(model, init_device_mesh("cpu", (size,)), plan)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step, {"step": alone}, params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--layout", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    step, phases, params = (pipeline if args.layout == "pipeline" else tensor)(args, rank, size)
    measure(step, args, phases, params, allgather_object, rank, size, None,
            extra={"layout": args.layout, "microbatches": args.microbatches, "hidden": args.hidden,
                   "blocks": args.blocks, "sequence": args.sequence})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
