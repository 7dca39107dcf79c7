"""policy="auto" keeps codes, then their steps drift: the last rank's backward sleeps NATIVE_S in
every step on the framework's allreduce (a link slow for float32: codes win the trials), then,
DRIFT_WINDOW codes steps after the decision (the settled window), DRIFT_S in codes steps too.
The ranks must time every path again at the same step and decide alike.

    torchrun --nproc-per-node 2 drift_checks.py OUTDIR      (the DDP hook, Gloo)

Each rank saves OUTDIR/drift_rank<r>.npz (tests/test_ddp.py): its decisions after every step
(JSON, one a step) and its parameters at the end.
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
from hvd_aps._schedule import DRIFT_WINDOW, max_trial_steps

NATIVE_S = 0.1  # the slow float32 allreduce: ten times this model's codes step
DRIFT_S = 0.05  # then codes steps too: several times their settled median
STEPS = 2 * max_trial_steps() + 2 * DRIFT_WINDOW + 20  # the trials, both windows, the trials again

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
compressor = hvd_aps.APSCompressor("e4m3", policy="auto", min_elements=16)
drifting = False


def slow_rank(*_):
    native = compressor.exchanger.native_dtype() is not None
    time.sleep(NATIVE_S if native else DRIFT_S if drifting else 0.0)


if rank == size - 1:  # the first layer's backward is the last of the step's
    model[0].register_full_backward_hook(slow_rank)
net = DDP(model)
net.register_comm_hook(hvd_aps.ddp.APSState(compressor), hvd_aps.ddp.aps_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
decisions, decided = [], None
for step in range(STEPS):
    opt.zero_grad()
    net(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
    opt.step()
    now = compressor.decisions()
    policy = now["policy"]
    decisions.append(json.dumps(now, sort_keys=True))
    decided = step if decided is None and policy == "codes" else decided
    drifting = decided is not None and step >= decided + DRIFT_WINDOW
np.savez(f"{sys.argv[-1]}/drift_rank{rank}.npz", decisions=np.array(decisions),
         params=torch.cat([p.detach().ravel() for p in model.parameters()]).numpy())
leave_torchrun()
