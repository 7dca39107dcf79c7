"""Run under `torchrun --nproc-per-node 2` (Gloo on loopback): the DDP hook, FSDP2's reduce-scatter
and HSDP's cross-host all-reduce hook on the counting stand-in for CuPy (standin_device.py). Each
entry point trains STEPS steps of a model of 1, 10 or 1000 parameters with and without the
stand-in; each rank saves OUTDIR/device_rank<r>.json: per run, what its last step did on the
device and whether its parameters are bit for bit the host engine's."""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
import hvd_aps.fsdp
from common import leave_torchrun
from standin_device import ELEMENTS, Tensors, counted, on_device, place_of, standin, summary

STEPS = 3  # two to warm up, the last counted

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
PLACE = place_of(rank)


def compressor(chunks: int):
    chunk_bytes = 0 if chunks == 1 else 4 * ELEMENTS // chunks
    return hvd_aps.APSCompressor("e4m3", chunk_bytes=chunk_bytes, hierarchical=False, seed=5)


def ddp(count: int, chunks: int):
    model = Tensors(count, rank)
    net = DDP(model, bucket_cap_mb=64)
    state = hvd_aps.ddp.APSState(compressor(chunks))
    net.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    return model, net, state.close


def fsdp(count: int, chunks: int):
    model = Tensors(count, rank)
    fully_shard(model)
    hvd_aps.fsdp.apply(model, compressor(chunks))
    return model, model, lambda: None


def hsdp(count: int, chunks: int):
    """Sharded on a mesh of one rank per 'host', replicated across the two: the codes go in the
    all-reduce hook."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = Tensors(count, rank)
    fully_shard(model, mesh=mesh["shard"])
    hvd_aps.fsdp.apply(model, compressor(chunks), replicate_group=mesh["replicate"].get_group())
    return model, model, lambda: None


def train(make, count: int, chunks: int, device: bool) -> dict:
    """STEPS SGD steps -> summary() of the parameters after and of the last step's device events."""
    with on_device(device, PLACE):
        model, net, close = make(count, chunks)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for step in range(STEPS):
            if step == STEPS - 1:
                dist.barrier()
                standin.COUNTS.reset()
            opt.zero_grad()
            net(step).backward()
            opt.step()
        events = counted() if device else None
        close()
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().ravel()
                        for p in model.parameters()]).numpy()
    return summary(params, events)


out = {"place": [PLACE.stream, PLACE.device]}
for name, make, chunkings in (("ddp", ddp, (1, 8)), ("fsdp", fsdp, (1,)), ("hsdp", hsdp, (1, 8))):
    for count in (1, 10, 1000):
        for chunks in chunkings:
            device, host = train(make, count, chunks, True), train(make, count, chunks, False)
            out[f"{name}-{count}t-{chunks}c"] = dict(device, same_bits=device["digest"] == host["digest"])
with open(f"{sys.argv[1]}/device_rank{rank}.json", "w") as f:
    json.dump(out, f)
leave_torchrun()
