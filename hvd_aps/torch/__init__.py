"""hvd_aps for horovod.torch: the APSCompressor adapter (Horovod's collectives for the exchange
driver, used by hvd_aps.APSCompressor itself) and DistributedOptimizer, whose buckets are fixed at
construction and whose results land in the gradients in place."""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
