"""Run under horovodrun's elastic mode (tests/test_integrations.py): APSCompressor on Horovod's optimizer with error
feedback in hvd.elastic.run with a TorchState; the host-discovery script grows the job from 2 to
3 ranks after step 4. The compressor stays out of the state (ObjectState.sync would give every
rank rank 0's copy) and resets through its callback: this rank's residuals survive, the shard
owners' (shaped by the old world) do not. Each rank saves OUTDIR/elastic_<rank>.npz."""
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps

OUT, HOSTS = sys.argv[1], sys.argv[2]
GIVE_UP = 100  # steps: the job never grew
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
comp = hvd_aps.APSCompressor("e2m1fn", min_elements=64, error_feedback=True)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                               compression=comp)
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
seen = {"resets": 0, "kept": True, "owners_dropped": True, "last": None}


def on_reset():
    before = seen["last"]
    comp.on_world_change()  # the recipe: hvd_aps's reset callback
    after = comp.state_dict()["residuals"]
    seen["resets"] += 1
    if before is not None:
        mine = {k: v for k, v in before.items() if "|send|" in k}
        seen["kept"] &= bool(mine) and all(np.array_equal(after[k], v) for k, v in mine.items())
        seen["owners_dropped"] &= not any("|owner|" in k for k in after)


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.step < 10 or (hvd.size() < 3 and state.step < GIVE_UP):  # every rank decides alike
        opt.zero_grad()
        gen = torch.Generator().manual_seed(100 * state.step + hvd.rank())
        model(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
        state.step += 1
        if state.step > 4 and hvd.size() < 3:
            time.sleep(0.2)  # give the driver's host discovery (once a second) time to see the new slot
        seen["last"] = comp.state_dict()["residuals"]
        if state.step == 4 and hvd.rank() == 0 and hvd.size() == 2:
            with open(HOSTS, "w") as f:
                f.write("localhost:3\n")
        state.commit()


train(state)
params = torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()
np.savez(f"{OUT}/elastic_{hvd.rank()}.npz", params=params, size=np.array(hvd.size()), resets=np.array(seen["resets"]),
         kept=np.array(seen["kept"]), owners_dropped=np.array(seen["owners_dropped"]))
