"""hvd_aps.diloco.DiLoCo across sites over FSDP2 inside each (tests/test_diloco.py): under
`torchrun --nproc-per-node 4`, Gloo on loopback, two sites of two ranks (a 2 x 2 mesh: replicate,
shard), the model sharded inside a site, DiLoCo's outer exchange (codes with error feedback) over
the replicate group, every site's batches its own. Each rank saves OUTDIR/diloco_fsdp_rank<r>.npz:
its local shards after every step."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_aps
import hvd_aps.diloco
from common import DILOCO_STEPS, diloco_batch, diloco_model, leave_torchrun

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
site = mesh.get_coordinate()[0]
model = diloco_model()
for layer in (model[0], model[2], model[4]):
    fully_shard(layer, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
diloco = hvd_aps.diloco.DiLoCo(model, inner, sync_every=4, process_group=mesh["replicate"].get_group(),
                               compression=hvd_aps.APSCompressor("e3m0", error_feedback=True, seed=9))
after = []
for step in range(DILOCO_STEPS):
    x, y = diloco_batch(step, site)  # the site's batch, the same on both of its ranks
    diloco.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    diloco.step()
    after.append(torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).numpy().copy())
np.savez(f"{sys.argv[1]}/diloco_fsdp_rank{rank}.npz", shards=np.stack(after), site=np.array(site),
         shard=np.array(mesh.get_coordinate()[1]))
leave_torchrun()
