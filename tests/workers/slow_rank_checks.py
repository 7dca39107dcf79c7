"""A slow rank: policy="auto" and the chunking tuned at run time while the last rank's backward
sleeps in a hook (several times the others' backward).

    torchrun --nproc-per-node 2 slow_rank_checks.py OUTDIR                 (the DDP hook, Gloo)
    horovodrun -np 2 --gloo python slow_rank_checks.py horovod OUTDIR      (the one line, Horovod's optimizer)

Each rank saves OUTDIR/slow_rank<r>.npz (tests/test_ddp.py, tests/test_horovod_torch.py): its
decisions after every step (JSON, one a step), its parameters at the end and its step times.
"""
import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
from common import leave_torchrun
from hvd_aps._schedule import max_trial_steps

SLEEP_S = 0.02  # a slow rank's extra backward: several times this model's whole backward on one core
STEPS = max_trial_steps() + 40  # the chunkings' trials, every round of policy="auto"'s, then steps after it decided

HOROVOD = sys.argv[1:-1] == ["horovod"]
if HOROVOD:
    import horovod.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
else:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
if rank == size - 1:  # the first layer's backward is the last of the step's
    model[0].register_full_backward_hook(lambda *_: time.sleep(SLEEP_S))
compressor = hvd_aps.APSCompressor("e4m3", policy="auto", min_elements=16)
if HOROVOD:
    net, opt = model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                               named_parameters=model.named_parameters(), compression=compressor)
else:
    net = DDP(model, bucket_cap_mb=0.3)  # a few buckets
    net.register_comm_hook(hvd_aps.ddp.APSState(compressor), hvd_aps.ddp.aps_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
decisions, seconds = [], []
for _ in range(STEPS):
    started = time.perf_counter()
    opt.zero_grad()
    net(torch.randn(32, 256, generator=gen)).pow(2).mean().backward()
    opt.step()
    seconds.append(time.perf_counter() - started)
    decisions.append(json.dumps(compressor.decisions(), sort_keys=True))
np.savez(f"{sys.argv[-1]}/slow_rank{rank}.npz", decisions=np.array(decisions), seconds=np.array(seconds),
         params=torch.cat([p.detach().ravel() for p in model.parameters()]).numpy())
if HOROVOD:
    hvd.shutdown()
else:
    leave_torchrun()
