"""Run by tests/test_resume.py under `horovodrun -np 2 --gloo`, twice (mode in HVD_APS_MODE):
`straight` trains STEPS steps through hvd.DistributedOptimizer with APSCompressor (and through
hvd_aps.torch.DistributedOptimizer, the codes optimizer), saving a checkpoint per rank (model,
optimizer, compressor) at STEPS // 2; `second`, a fresh process, loads it and trains the rest (for UNLOADED settings, also once without the compressor's state). Each rank
saves OUTDIR/hvd_<mode>_rank<r>.npz."""
import os
import sys

import horovod.torch as hvd
import torch

import hvd_aps
import hvd_aps.torch
from common import RESUME_ENGINES, RESUME_HOROVOD as SETTINGS, straight_or_resumed

STEPS, WIDTH, LAYERS = 8, 256, 6
UNLOADED = ("codes_optimizer",)  # resumed also without the compressor's state: it must end elsewhere

hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
outdir, mode = sys.argv[1], os.environ["HVD_APS_MODE"]


def build(setting):
    os.environ["HVD_APS_ENGINE"] = RESUME_ENGINES.get(setting, "auto")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    # min_elements=0: the biases too travel as codes. Horovod's own float32 allreduce, which
    # carries what is smaller, sums in an order that its fusion of the moment decides: not the same
    # bits run to run beyond 2 ranks (docs/faults.md)
    compressor = hvd_aps.APSCompressor("e3m0", bucket_bytes=1 << 19, min_elements=0, **SETTINGS[setting])
    wrap = hvd_aps.torch.DistributedOptimizer if setting == "codes_optimizer" else hvd.DistributedOptimizer
    opt = wrap(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), named_parameters=net.named_parameters(),
               compression=compressor)
    return net, net, opt, compressor, compressor.close


straight_or_resumed(build, SETTINGS, "hvd_", outdir, mode, rank, STEPS, WIDTH, UNLOADED)
