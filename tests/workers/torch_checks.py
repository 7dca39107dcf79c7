"""Run under `horovodrun -np 2 --gloo`: APSCompressor through horovod.torch; each rank saves what it
got to OUTDIR/torch_rank<r>.npz for tests/test_horovod_torch.py to compare."""
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
from common import poisoned, rank_data

hvd.init()
rank, out = hvd.rank(), {}


def reduce(x, comp, op=hvd.Average, name=None):
    return hvd.allreduce(torch.from_numpy(x), op=op, compression=comp, name=name).numpy()


e4m3 = hvd_aps.APSCompressor(hvd_aps.e4m3)
out["avg"] = reduce(rank_data(rank), e4m3, name="avg")
out["avg_shift"] = np.array(e4m3.stats["float32[1000]"].shift)
out["sum_e5m2"] = reduce(rank_data(rank, sigma=3.0, seed=1), hvd_aps.APSCompressor("e5m2"), hvd.Sum, "sum")
out["naive"] = reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3", scaling=None), name="naive")
out["zeros"] = reduce(np.zeros(100, np.float32), e4m3, name="zeros")
out["nan"] = reduce(poisoned(rank, np.nan), e4m3, name="nan")
out["inf"] = reduce(poisoned(rank, np.inf), hvd_aps.APSCompressor("e2m1fn"), name="inf")
out["after"] = reduce(rank_data(rank), e4m3, name="after")
half = hvd.allreduce(torch.from_numpy(rank_data(rank)).bfloat16(), compression=e4m3, name="bf16")
out["bf16_dtype_ok"] = np.array(half.dtype == torch.bfloat16)
ints = hvd.allreduce(torch.arange(5) * (rank + 1), op=hvd.Sum, compression=e4m3, name="ints")
out["ints"] = ints.numpy()


def train(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=hvd_aps.APSCompressor("e4m3"), **kwargs)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(kwargs.get("backward_passes_per_step", 1)):
            model(torch.randn(8, 10, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()


out["params_avg"] = train()
out["params_sum_groups"] = train(op=hvd.Sum, groups=2)
out["params_bpps_predivide"] = train(backward_passes_per_step=2, gradient_predivide_factor=2.0)

try:  # rank 0 sends e4m3, rank 1 e5m2: same float16 carrier, so only the signature can tell
    reduce(rank_data(rank), hvd_aps.APSCompressor("e4m3" if rank == 0 else "e5m2"), name="mismatch")
    out["mismatch"] = np.array("no error")
except ValueError as err:
    out["mismatch"] = np.array(str(err))

np.savez(f"{sys.argv[1]}/torch_rank{rank}.npz", **out)
