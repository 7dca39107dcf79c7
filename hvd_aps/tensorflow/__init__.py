"""hvd_aps for horovod.tensorflow: the APSCompressor adapter (Horovod's graph collectives for the
exchange driver, used by hvd_aps.APSCompressor itself) and allreduce_codes / DistributedGradientTape,
which send the codes in buckets without Horovod's optimizer."""
from .tape import DistributedGradientTape, allreduce_codes

__all__ = ["DistributedGradientTape", "allreduce_codes"]
