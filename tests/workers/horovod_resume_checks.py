"""Run by tests/test_resume.py under `horovodrun -np 2 --gloo`, three times (mode in HVD_APS_MODE):
`straight` trains STEPS steps through hvd.DistributedOptimizer with APSCompressor (and through
hvd_aps.torch.DistributedOptimizer, the codes optimizer); `first` trains STEPS // 2 and saves a
checkpoint per rank (model, optimizer, compressor); `second`, a fresh process, loads it and
trains the rest. Each rank saves OUTDIR/hvd_<mode>_rank<r>.npz."""
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
import hvd_aps.torch

STEPS, WIDTH, LAYERS = 8, 256, 6
SETTINGS = {"feedback": dict(error_feedback=True), "stochastic": dict(rounding="stochastic", seed=11),
            "codes_optimizer": dict(error_feedback=True, rounding="stochastic", seed=5)}

hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
outdir, mode = sys.argv[1], os.environ["HVD_APS_MODE"]


def train(setting, steps, checkpoint=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    compressor = hvd_aps.APSCompressor("e3m0", bucket_bytes=1 << 19, **SETTINGS[setting])
    wrap = hvd_aps.torch.DistributedOptimizer if setting == "codes_optimizer" else hvd.DistributedOptimizer
    opt = wrap(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), named_parameters=net.named_parameters(),
               compression=compressor)
    if checkpoint is not None:
        saved = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        compressor.load_state_dict(saved["compressor"])
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    compressor.close()
    return net, opt, compressor


out = {}
for setting in SETTINGS:
    path = f"{outdir}/hvd_{setting}_rank{rank}.pt"
    if mode == "straight":
        net, _, _ = train(setting, range(STEPS))
    elif mode == "first":
        net, opt, compressor = train(setting, range(STEPS // 2))
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "compressor": compressor.state_dict()}, path)
    else:
        net, _, _ = train(setting, range(STEPS // 2, STEPS), checkpoint=path)
    out[setting] = torch.cat([p.detach().ravel() for p in net.parameters()]).numpy()
np.savez(f"{outdir}/hvd_{mode}_rank{rank}.npz", **out)
