"""Run under `torchrun --nproc-per-node 2`, Gloo on loopback: DistributedDataParallel as its own
users turn it on, each scenario twice, without a hook and with hvd_aps.ddp.aps_hook (every
gradient as codes). Each rank saves every run's final parameters (or its error) to
OUTDIR/ddpdropin_rank<r>.npz for tests/test_dropin.py."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
from common import leave_torchrun
from two_heads import STEPS, TwoHeads, save_outcome, sgd

dist.init_process_group("gloo")
rank, out = dist.get_rank(), {}
torch.set_num_threads(1)

def train(hook, both=False, batches=STEPS, join=False, **ddp_kwargs):
    """SGD through DDP over `batches` batches on this rank -> the final parameters, flat."""
    model = TwoHeads()
    ddp = DDP(model, **ddp_kwargs)
    if hook:
        ddp.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0)),
                               hvd_aps.ddp.aps_hook)
    with ddp.join(enable=join):
        return sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, batches, lambda x: ddp(x, both))


for run, hook in (("stock", False), ("codes", True)):
    save_outcome(out, f"ddp_unused_{run}", lambda: train(hook, both=rank == 1, find_unused_parameters=True))
    save_outcome(out, f"ddp_static_{run}", lambda: train(hook, static_graph=True))
    save_outcome(out, f"ddp_view_{run}", lambda: train(hook, both=True, gradient_as_bucket_view=True))
    save_outcome(out, f"ddp_join_{run}", lambda: train(hook, both=True, batches=STEPS - rank, join=True))
np.savez(f"{sys.argv[1]}/ddpdropin_rank{rank}.npz", **out)
leave_torchrun()
