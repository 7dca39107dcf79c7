"""A worker killed under Horovod elastic (tests/test_integrations.py). Two modes:

    horovodrun --min-np 2 --max-np 3 --host-discovery-script ... --gloo python
        elastic_kill_checks.py WRAPPER elastic OUTDIR
    horovodrun -np 2 --gloo python elastic_kill_checks.py WRAPPER reference OUTDIR

WRAPPER: one-line (APSCompressor on hvd.DistributedOptimizer) or codes-optimizer
(hvd_aps.torch.DistributedOptimizer). elastic: 3 ranks (2 on host localhost, 1 on host
127.0.0.1) train with error feedback in hvd.elastic.run, committing every step; at step KILL_STEP the rank on 127.0.0.1
SIGKILLs itself during backward. The survivors' collectives fail, Horovod restores the last
commit, blacklists the host and goes on with 2 ranks; the reset callback (the recipe's
on_world_change) saves each survivor's restored state (model, optimizer, compressor, step) and
beside it what that process held when it last committed, which the restored state must equal.
reference: a plain 2-rank job loads those states and trains the same remaining steps: a job
that was never interrupted from that point. Each rank saves OUTDIR/<mode>_rank<r>.npz (its final
parameters, the world size it ended in).
"""
import copy
import os
import signal
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
import hvd_aps.torch

STEPS, KILL_STEP = 10, 4
WRAPPER, MODE, OUT = sys.argv[1:4]
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
# a collective that never ends (a request Horovod lost as it shut down) raises NoAnswer after this,
# which Horovod elastic resets on, well within the test's bound
TIMEOUT_S = 60
comp = hvd_aps.APSCompressor("e2m1fn", min_elements=0, error_feedback=True, timeout=TIMEOUT_S)
wrap = hvd_aps.torch.DistributedOptimizer if WRAPPER == "codes-optimizer" else hvd.DistributedOptimizer
opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), compression=comp)


def saved_state(rank):
    return f"{OUT}/reset_rank{rank}.pt"


def step(n):
    opt.zero_grad()
    gen = torch.Generator().manual_seed(100 * n + hvd.rank())
    model(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
    opt.step()


def held(state) -> dict:
    """A copy of what this process holds: model, optimizer, compressor, step."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "compressor": comp.state_dict(),
                          "step": state.step})


def elastic():
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    committed = {}  # what this process held at its last commit

    def on_reset():
        comp.on_world_change()
        torch.save({**held(state), "committed": committed}, saved_state(hvd.rank()))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == KILL_STEP and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
                model[0].register_full_backward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            step(state.step)
            state.step += 1
            committed.update(held(state))
            state.commit()

    train(state)


def reference():
    saved = torch.load(saved_state(hvd.rank()), weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    comp.load_state_dict(saved["compressor"])
    for n in range(saved["step"], STEPS):
        step(n)


if MODE == "elastic":
    elastic()
else:
    reference()
np.savez(f"{OUT}/{MODE}_rank{hvd.rank()}.npz", size=np.array(hvd.size()),
         params=torch.cat([p.detach().ravel() for p in model.parameters()]).numpy())
