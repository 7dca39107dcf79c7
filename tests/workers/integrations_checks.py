"""Run under `torchrun --nproc-per-node 2`, CPU: the README's recipes for HF Accelerate and
PyTorch Lightning, each training a small model with hvd_aps.ddp.aps_hook. Each rank saves
OUTDIR/integrations_rank<r>.npz for tests/test_integrations.py."""
import os
import sys

import numpy as np
import torch

import hvd_aps
import hvd_aps.ddp

out = {}


def data(rank):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=gen)
    return x, x @ torch.linspace(-1, 1, 16)[:, None]


def accelerate_run():
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    # Accelerate's DistributedDataParallelKwargs(comm_hook=...) takes only its own hooks: register
    # aps_hook on the prepared (DDP) model instead
    state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor("e4m3", min_elements=16))
    model.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    x, y = data(accelerator.process_index)
    for _ in range(5):
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    out["accelerate"] = torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()
    out["accelerate_buckets"] = np.array(state.buckets_exchanged)
    state.close()


def lightning_run():
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class APSHook(pl.Callback):
        """DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA devices only: on the CPU,
        register aps_hook on the DDP-wrapped model once fit has wrapped it."""

        def __init__(self, compressor):
            self.state = None
            self.compressor = compressor

        def on_fit_start(self, trainer, module):
            self.state = hvd_aps.ddp.APSState(self.compressor)
            trainer.strategy.model.register_comm_hook(self.state, hvd_aps.ddp.aps_hook)

    rank = int(os.environ["RANK"])
    x, y = data(rank)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    hook = APSHook(hvd_aps.APSCompressor("e4m3", min_elements=16))
    module = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[hook], use_distributed_sampler=False)
    trainer.fit(module, loader)
    out["lightning"] = torch.cat([p.detach().ravel() for p in module.parameters()]).numpy()
    out["lightning_buckets"] = np.array(hook.state.buckets_exchanged)


accelerate_run()
lightning_run()
np.savez(f"{sys.argv[1]}/integrations_rank{os.environ['RANK']}.npz", **out)
