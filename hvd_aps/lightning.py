"""PyTorch Lightning: the compressor's fidelity in the trainer's logger (hvd_aps.dashboard).

    trainer = pl.Trainer(..., callbacks=[hvd_aps.lightning.FidelityLogger(compressor)])

writes, after every `every` training batches, the last step's relative error, flushed and
saturated shares, bytes sent and each bucket's APS shift through `trainer.logger.log_metrics`
(TensorBoardLogger, CSVLogger, any Lightning logger), on the global zero rank as Lightning's
loggers do.
"""
try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package's name
    from pytorch_lightning import Callback

from . import dashboard
from .compressor import APSCompressor


class FidelityLogger(Callback):
    def __init__(self, compressor: APSCompressor, every: int = 1):
        super().__init__()
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (batches between writes), got {every!r}")
        self.compressor, self.every, self._sent = compressor, every, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.every:
            return
        fidelity = dashboard.step_fidelity(self.compressor.recorder, self._sent)
        self._sent = self.compressor.recorder.bytes_sent
        if trainer.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(fidelity.scalars(), step=trainer.global_step)
