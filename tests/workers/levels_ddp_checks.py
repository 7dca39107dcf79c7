"""Run by tests/hosts_run.py as 2 hosts x 2 ranks (torch.distributed, Gloo): the DDP hook and the
FSDP2 cross-host hook on two levels. Each rank saves OUTDIR/levels_ddp_rank<r>.npz."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps._host_memory
import hvd_aps.ddp
import hvd_aps.fsdp
from common import DDP_SIZES, codes_grads, leave_torchrun
from torch_models import Given

dist.init_process_group("gloo")
rank, out = dist.get_rank(), {}
torch.set_num_threads(1)


model = Given(DDP_SIZES)
ddp = DDP(model)  # one bucket, in reverse parameter order
state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3", min_elements=16))
ddp.register_comm_hook(state, hvd_aps.ddp.aps_hook)
ddp([torch.from_numpy(g) for g in codes_grads(rank, DDP_SIZES)]).backward()
for i, p in enumerate(model.ps):
    out[f"ddp_{i}"] = p.grad.numpy().copy()
out["ddp_two_levels"] = np.array(state.lane(0, "cpu")[0].local is not None)
out["ddp_host_memory"] = np.array(isinstance(state.lane(0, "cpu")[0].local, hvd_aps._host_memory.HostMemory))
state.close()



def hsdp_trained(mesh, compressor=None, replicate=None):
    """A small net sharded on `mesh`, codes across hosts where a compressor is given, after three
    SGD steps on this rank's own data (SGD: a wrong average would show, where Adam's steps would
    hide its scale) -> (its full parameters before, after)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
    fully_shard(net, mesh=mesh)
    if compressor is not None:
        hvd_aps.fsdp.apply(net, compressor, replicate_group=replicate)
    full = lambda: torch.cat([p.full_tensor().detach().ravel() for p in net.parameters()]).numpy()
    before, opt = full(), torch.optim.SGD(net.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    return before, full()


shard_mesh, replicate = hvd_aps.fsdp.host_mesh()
out["hsdp_before"], out["hsdp"] = hsdp_trained(shard_mesh, hvd_aps.APSCompressor("e4m3"), replicate)
out["hsdp_torch"] = hsdp_trained(hvd_aps.fsdp.hsdp_mesh())[1]  # torch's own HSDP: float32 across hosts
np.savez(f"{sys.argv[1]}/levels_ddp_rank{rank}.npz", **out)
leave_torchrun()
