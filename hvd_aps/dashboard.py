"""The compressor's fidelity where users look during training: TensorBoard.

    compressor.log_to(writer, step)

writes what the last step's exchanges did, as scalars under "hvd_aps/": the relative error of the
values sent (||q(g) - g|| / ||g|| over every tensor of the step together), the shares of nonzero
values flushed to zero and saturated (beyond the format's largest value after APS's scale), the
bytes this rank sent since the last call, and each bucket's APS shift ("hvd_aps/shift/<bucket>":
the median of its tensors'). `writer`: torch's SummaryWriter, tf.summary.create_file_writer's, or
anything with `add_scalar(tag, value, step)`. Only rank 0 writes unless `every_rank=True`. Nothing
is computed unless it is called: it reads the statistics the compressor keeps anyway
(`stats_table()`). hvd_aps.keras.FidelityLogger and hvd_aps.lightning.FidelityLogger call it from
Keras's and Lightning's training loops.
"""
import dataclasses
import math
import os
from typing import Protocol

import numpy as np

from ._stats import TensorStats

PREFIX = "hvd_aps/"
_RANK_VARIABLES = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


class ScalarWriter(Protocol):
    """What log_to writes through: torch's SummaryWriter has it; TensorFlow's writers are adapted."""

    def add_scalar(self, tag: str, value: float, step: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """One step's statistics, as log_to writes them."""
    relative_error: float
    flushed: float
    saturated: float
    bytes_sent: int
    shifts: dict  # bucket name -> its tensors' median APS shift

    @classmethod
    def of(cls, total: TensorStats, bytes_sent: int, shifts: dict) -> "Fidelity":
        saturated = total.saturated / total.elements if total.elements else 0.0
        return cls(total.relative_error, total.flushed, saturated, bytes_sent, shifts)

    def scalars(self) -> dict:
        values = {"relative_error": self.relative_error, "flushed": self.flushed, "saturated": self.saturated,
                  "bytes_sent": float(self.bytes_sent)}
        values.update({f"shift/{bucket}": float(shift) for bucket, shift in self.shifts.items()})
        return {PREFIX + name: value for name, value in values.items() if math.isfinite(value)}


def this_rank() -> int:
    """This process's rank as its launcher numbered it (horovodrun, torchrun, mpirun, srun); 0 alone."""
    for name in _RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


class _TensorFlowWriter:
    """A tf.summary writer as a ScalarWriter."""

    def __init__(self, writer):
        self.writer = writer

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        import tensorflow as tf
        with self.writer.as_default():
            tf.summary.scalar(tag, value, step=step)


def scalar_writer(writer) -> ScalarWriter:
    """`writer` as a ScalarWriter: itself where it has add_scalar, adapted where it is TensorFlow's."""
    if hasattr(writer, "add_scalar"):
        return writer
    if hasattr(writer, "as_default"):
        return _TensorFlowWriter(writer)
    raise TypeError(f"log_to writes through torch's SummaryWriter, a tf.summary writer or an object with "
                    f"add_scalar(tag, value, step), got {type(writer).__name__}")


def step_fidelity(recorder, sent_before: int) -> Fidelity:
    """The last step's Fidelity from a compressor's StatsRecorder (bytes since `sent_before`)."""
    last = {label: stats for label, stats in recorder.last.items() if stats is not None}
    total = sum(last.values(), TensorStats())
    shifts = {bucket: float(np.median(values)) for bucket, values in recorder.bucket_shifts().items() if len(values)}
    return Fidelity.of(total, recorder.bytes_sent - sent_before, shifts)


def write(fidelity: Fidelity, writer, step: int) -> None:
    out = scalar_writer(writer)
    for tag, value in fidelity.scalars().items():
        out.add_scalar(tag, value, step)
