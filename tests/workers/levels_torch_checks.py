"""Run by tests/hosts_run.py as 2 hosts x 2 ranks: the two-level exchange through horovod.torch
(APSCompressor on Horovod's allreduce and optimizer, hvd_aps.torch.DistributedOptimizer), with
Horovod's dynamic process sets (argv[2] "dynamic") or a plain hvd.init() ("plain"), float32
inside a host through shared memory, or ("plain-tcp") through Horovod's own alltoall. Each rank
saves OUTDIR/levels_torch_<mode>_rank<r>.npz for tests/test_levels.py."""
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
import hvd_aps._host_memory
import hvd_aps.torch
from common import CODES_SIZES, codes_grads

MODE = sys.argv[2]
if MODE == "plain-tcp":
    os.environ["HVD_APS_HOST_MEMORY"] = "0"
hvd.init(process_sets="dynamic") if MODE == "dynamic" else hvd.init()
rank, out = hvd.rank(), {}
BIG = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]

for fmt in ("e4m3", "e2m1fn"):
    comp = hvd_aps.APSCompressor(fmt, min_elements=16)
    grads = [torch.from_numpy(codes_grads(rank)[i].copy()) for i in BIG]
    for i, g in zip(BIG, hvd.grouped_allreduce(grads, compression=comp, name=f"levels_{fmt}")):
        out[f"grouped_{fmt}_{i}"] = g.numpy()
    levels = hvd_aps.torch.adapter.levels(None)
    out[f"levels_{fmt}"] = np.array(levels.local is not None)
    memory = isinstance(levels.local, hvd_aps._host_memory.HostMemory)
    out[f"host_memory_{fmt}"] = np.array(memory)
    out[f"subgroups_{fmt}"] = np.array(isinstance(levels.local.fallback if memory else levels.local,
                                                  hvd_aps.exchange.Subgroup))
    out[f"bytes_{fmt}"] = np.array(comp.bytes_sent)

params = [torch.zeros(codes_grads(rank)[i].shape, requires_grad=True) for i in BIG]
opt = hvd_aps.torch.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), [(f"p{i}", p) for i, p in zip(BIG, params)],
                                         compression=hvd_aps.APSCompressor("e4m3", min_elements=16))
sum((p * torch.from_numpy(codes_grads(rank)[i])).sum() for i, p in zip(BIG, params)).backward()
opt.synchronize()
for i, p in zip(BIG, params):
    out[f"optimizer_{i}"] = p.grad.numpy().copy()
flat = hvd_aps.APSCompressor("e4m3", min_elements=16, hierarchical=False)
grads = [torch.from_numpy(codes_grads(rank)[i].copy()) for i in BIG]
hvd.grouped_allreduce(grads, compression=flat, name="flat")
out["bytes_flat"] = np.array(flat.bytes_sent)
np.savez(f"{sys.argv[1]}/levels_torch_{MODE}_rank{rank}.npz", **out)
