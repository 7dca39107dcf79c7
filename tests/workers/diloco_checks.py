"""hvd_aps.diloco.DiLoCo on real ranks (tests/test_diloco.py): under `torchrun --nproc-per-node 2`
(Gloo on loopback) or `horovodrun -np 2 --gloo` (HVD_APS_BACKEND=horovod), twice (HVD_APS_MODE:
straight, second). `straight` trains every setting STEPS steps and saves a checkpoint (model, inner
optimizer, DiLoCo) after step SAVED_AFTER, while a streaming fragment's exchange is under way;
`second`, a fresh process, loads it and trains the rest; under torchrun INTELLECT-1's int8 ring
also averages vectors of RING_SIZES alone. Each rank saves
OUTDIR/diloco_<backend>_<mode>_rank<r>.npz: per setting the parameters after every step it took,
and what a mismatched setting raised."""
import os
import sys

import numpy as np
import torch

import hvd_aps
import hvd_aps.diloco
from common import (DILOCO_SETTINGS, DILOCO_STEPS as STEPS, RING_SIZES, diloco_batch, diloco_compressor, diloco_model,
                    diloco_settings, ring_input)

SAVED_AFTER = 6
backend = os.environ.get("HVD_APS_BACKEND", "torch")
if backend == "torch":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
torch.set_num_threads(1)
outdir, mode = sys.argv[1], os.environ["HVD_APS_MODE"]


def built(setting):
    model = diloco_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = dict(DILOCO_SETTINGS[setting])
    diloco = hvd_aps.diloco.DiLoCo(model, inner, compression=diloco_compressor(options.pop("compression")),
                                   backend=backend, **options)
    return model, inner, diloco


def train(setting):
    """The setting's steps in this mode -> the parameters after each step."""
    model, inner, diloco = built(setting)
    path = f"{outdir}/diloco_{backend}_{setting}_rank{rank}.pt"
    span = range(STEPS) if mode == "straight" else range(SAVED_AFTER, STEPS)
    if mode == "second":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
    after = []
    for step in span:
        x, y = diloco_batch(step, rank)
        diloco.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        diloco.step()
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
        if mode == "straight" and step + 1 == SAVED_AFTER:
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, path)
    return np.stack(after)


out = {setting: train(setting) for setting in diloco_settings(backend)}
if backend == "torch":  # INTELLECT-1's ring on its own, on sizes the model's fragments do not have
    ring = diloco_compressor("int8")
    for size in RING_SIZES:
        out[f"ring{size}"] = ring.wait(ring.start(torch.from_numpy(ring_input(size, rank)), None)).numpy()
    try:  # a float32 run's checkpoint is not resumed under the int8 ring
        built("int8")[2].load_state_dict(built("float32")[2].state_dict())
    except ValueError as err:
        out["outer_mismatch"] = np.array(str(err))
try:  # rank 1 syncs every 5 steps: every rank refuses at construction
    hvd_aps.diloco.DiLoCo(diloco_model(), torch.optim.SGD(diloco_model().parameters(), lr=0.1),
                          sync_every=4 + rank, backend=backend)
except ValueError as err:
    out["mismatch"] = np.array(str(err))
np.savez(f"{outdir}/diloco_{backend}_{mode}_rank{rank}.npz", **out)
if backend == "torch":
    from common import leave_torchrun
    leave_torchrun()
