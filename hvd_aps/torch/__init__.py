"""hvd_aps for horovod.torch: the APSCompressor adapter (used by hvd_aps.APSCompressor itself) and
DistributedOptimizer, which sends the codes themselves instead of float16 values."""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
