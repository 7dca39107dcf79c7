"""hvd_aps for horovod.tensorflow: the APSCompressor adapter (used by hvd_aps.APSCompressor itself)
and DistributedGradientTape, which sends the codes themselves instead of float16 values."""
from .tape import DistributedGradientTape, allreduce_codes

__all__ = ["DistributedGradientTape", "allreduce_codes"]
