"""Run under `torchrun --nproc-per-node 2`, Gloo on loopback: hvd_aps.pipelining and
hvd_aps.tensor_parallel (tests/test_model_parallel.py). Each rank saves OUTDIR/mp_rank<r>.npz:

- pipeline: a 4-layer MLP split into stages (GPipe and 1F1B: 2 stages, one a rank; interleaved
  1F1B: 4 stages, two a rank), one step of 4 micro-batches with codes (e4m3 forward, e5m2
  backward), each stage's parameter gradients and loss, the bytes its sends carried;
- the codes collectives on known inputs: the sum, the reduce-scatter and the all-gather;
- tensor parallel: an MLP block (CodesColwiseParallel then CodesRowwiseParallel), plain (the sum)
  and sequence-parallel (all-gather, reduce-scatter), and the same with torch's own styles: the
  outputs, the input's gradient and the parameters' gradients, and the bytes the codes sent.
"""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hvd_aps
import hvd_aps.pipelining
import hvd_aps.tensor_parallel
from hvd_aps._codes_collectives import CodesCollectives
from common import MP_MICROBATCHES, TP_SHAPE, gather_shard, leave_torchrun, mp_batch, mp_layers

dist.init_process_group("gloo")
rank, size, out = dist.get_rank(), dist.get_world_size(), {}
torch.set_num_threads(1)
SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2)}


def pipeline(name):
    """One step of the schedule over the layers cut into stages (stage s: layers of s)."""
    schedule_class, per_rank = SCHEDULES[name]
    layers, stages = mp_layers(), size * per_rank
    per_stage = len(layers) // stages
    mine = [s for s in range(stages) if s % size == rank]
    built = [hvd_aps.pipelining.CodesPipelineStage(torch.nn.Sequential(*layers[s * per_stage:(s + 1) * per_stage]), s,
                                                    stages, torch.device("cpu"), forward="e4m3", backward="e5m2")
             for s in mine]
    x, y = mp_batch()
    losses = []
    schedule = schedule_class(built if per_rank > 1 else built[0], MP_MICROBATCHES,
                              loss_fn=torch.nn.functional.mse_loss)
    if rank == 0:  # the first stage (and with interleaving the third)
        schedule.step(x)
    else:  # the last stage
        schedule.step(target=y, losses=losses)
    for stage in built:
        grads = [p.grad.detach().reshape(-1) for p in stage.submod.parameters()]
        out[f"{name}_stage{stage.stage_index}_grads"] = torch.cat(grads).numpy()
        out[f"{name}_stage{stage.stage_index}_bytes"] = np.array(stage.bytes_sent)
    if losses:
        out[f"{name}_losses"] = torch.stack(losses).detach().numpy()


def collectives():
    """The codes collectives on known inputs: every rank's tensor, one shape."""
    codes = CodesCollectives(hvd_aps.APSCompressor("e4m3"), dist.group.WORLD, hvd_aps.BlockCodes("e4m3"))
    x = torch.from_numpy(gather_shard(rank, 6000).copy()).reshape(4, 1500)
    out["sum"] = codes.all_reduce(x, "sum").numpy()
    out["scattered"] = codes.reduce_scatter(x, 0, "scattered").numpy()
    out["gathered"] = codes.all_gather(x, 1).numpy()
    out["collective_bytes"] = np.array(codes.bytes_sent)


def block():
    torch.manual_seed(0)
    width = TP_SHAPE[-1]
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


def tensor_parallel(key, sequence, codes):
    mesh = init_device_mesh("cpu", (size,))
    net, compressor = block(), hvd_aps.APSCompressor("e4m3")
    shard = {"input_layouts": Shard(1)} if sequence else {}
    scatter = {"output_layouts": Shard(1)} if sequence else {}
    plan = ({"0": hvd_aps.tensor_parallel.CodesColwiseParallel(compressor, **shard),
             "2": hvd_aps.tensor_parallel.CodesRowwiseParallel(compressor, **scatter)} if codes else
            {"0": ColwiseParallel(**shard), "2": RowwiseParallel(**scatter)})
    parallelize_module(net, mesh, plan)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*TP_SHAPE, generator=gen)
    if sequence:
        x = x.chunk(size, dim=1)[rank].contiguous()
    x.requires_grad_(True)
    y = net(x)
    ((y - 3) ** 2).sum().backward()  # the gradient the output's own values, far from cancelling
    out[f"{key}_out"], out[f"{key}_input_grad"] = y.detach().numpy(), x.grad.numpy()
    out[f"{key}_grads"] = torch.cat([p.grad.to_local().reshape(-1) for p in net.parameters()]).numpy()
    if codes:
        out[f"{key}_bytes"] = np.array(hvd_aps.tensor_parallel.bytes_sent(plan.values()))


for name in SCHEDULES:
    pipeline(name)
collectives()
for sequence in (False, True):
    for codes in (False, True):
        tensor_parallel(f"{'sp' if sequence else 'tp'}_{'codes' if codes else 'float32'}", sequence, codes)
try:
    hvd_aps.tensor_parallel.CodesRowwiseParallel(hvd_aps.APSCompressor("e4m3", error_feedback=True))
except ValueError as err:
    out["feedback_refused"] = np.array(str(err))
np.savez(f"{sys.argv[1]}/mp_rank{rank}.npz", **out)
leave_torchrun()
