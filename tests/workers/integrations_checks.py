"""Run under `torchrun --nproc-per-node 2`, CPU: the README's recipes for HF Accelerate and
PyTorch Lightning, each training a small model with hvd_aps.ddp.aps_hook, the compressor's
fidelity logged to TensorBoard (compressor.log_to through torch's SummaryWriter in the Accelerate
run, under OUTDIR/tb_torch/rank<r>; hvd_aps.lightning.FidelityLogger through Lightning's
TensorBoardLogger under OUTDIR/tb_lightning). Each rank saves OUTDIR/integrations_rank<r>.npz for
tests/test_integrations.py."""
import os
import sys

import numpy as np
import torch

import hvd_aps
import hvd_aps.ddp
import hvd_aps.lightning

out = {}
OUT, RANK = sys.argv[1], int(os.environ["RANK"])


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
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(f"{OUT}/tb_torch/rank{RANK}")  # on every rank: log_to writes rank 0's alone
    for step in range(5):
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        state.compressor.log_to(writer, step)
    writer.close()
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

    x, y = data(RANK)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    compressor = hvd_aps.APSCompressor("e4m3", min_elements=16)
    hook = APSHook(compressor)
    module = Regression()
    logger = pl.loggers.TensorBoardLogger(f"{OUT}/tb_lightning", name="", version="")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[hook, hvd_aps.lightning.FidelityLogger(compressor)], use_distributed_sampler=False,
                         log_every_n_steps=1)
    trainer.fit(module, loader)
    out["lightning"] = torch.cat([p.detach().ravel() for p in module.parameters()]).numpy()
    out["lightning_buckets"] = np.array(hook.state.buckets_exchanged)


accelerate_run()
lightning_run()
np.savez(f"{OUT}/integrations_rank{RANK}.npz", **out)
