"""Run under `torchrun --nproc-per-node 2`, Gloo on loopback: DistributedDataParallel as its own
users turn it on, each scenario twice, without a hook and with hvd_aps.ddp.aps_hook (every
gradient as codes). Each rank saves every run's final parameters (or its error) to
OUTDIR/ddpdropin_rank<r>.npz for tests/test_dropin.py."""
import functools
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_aps
import hvd_aps.ddp
from common import leave_torchrun
from two_heads import STEPS, TwoHeads, loss, plain_step, save_outcome, sgd

dist.init_process_group("gloo")
rank, out = dist.get_rank(), {}
torch.set_num_threads(1)

def train(hook, both=False, batches=STEPS, join=False, no_sync=False, **ddp_kwargs):
    """SGD through DDP over `batches` batches on this rank (with `no_sync`, each batch's first half
    accumulated locally under ddp.no_sync(), its second half's backward exchanging both) -> the
    final parameters, flat."""
    model = TwoHeads()
    ddp = DDP(model, **ddp_kwargs)
    if hook:
        ddp.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0)),
                               hvd_aps.ddp.aps_hook)
    take_step = functools.partial(accumulated_step, ddp) if no_sync else plain_step
    with ddp.join(enable=join):
        return sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, batches, lambda x: ddp(x, both),
                   take_step)


def accumulated_step(ddp, opt, forward, x, y):
    """Gradient accumulation as DDP's users write it: the first half's backward under no_sync()."""
    opt.zero_grad()
    half = len(x) // 2
    with ddp.no_sync():
        loss(forward, x[:half], y[:half]).backward()
    loss(forward, x[half:], y[half:]).backward()
    opt.step()


for run, hook in (("stock", False), ("codes", True)):
    save_outcome(out, f"ddp_unused_{run}", lambda: train(hook, both=rank == 1, find_unused_parameters=True))
    save_outcome(out, f"ddp_static_{run}", lambda: train(hook, static_graph=True))
    save_outcome(out, f"ddp_view_{run}", lambda: train(hook, both=True, gradient_as_bucket_view=True))
    save_outcome(out, f"ddp_join_{run}", lambda: train(hook, both=True, batches=STEPS - rank, join=True))
    save_outcome(out, f"ddp_no_sync_{run}", lambda: train(hook, both=True, no_sync=True))
np.savez(f"{sys.argv[1]}/ddpdropin_rank{rank}.npz", **out)
leave_torchrun()
