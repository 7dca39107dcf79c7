"""Run by tests/hosts_run.py as 2 hosts x 2 ranks: the two-level exchange through
horovod.tensorflow (APSCompressor on Horovod's allreduce, hvd_aps.tensorflow's allreduce_codes
in a graph) after a plain hvd.init(): its groups are Subgroups of the global process set, their
stages graph ops. Each rank saves OUTDIR/levels_tf_rank<r>.npz."""
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvd_aps
import hvd_aps.tensorflow
from common import CODES_SIZES, codes_grads

hvd.init()
rank, out = hvd.rank(), {}
BIG = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]
comp = hvd_aps.APSCompressor("e4m3", min_elements=16)
grouped = tf.function(lambda xs: hvd.grouped_allreduce(xs, compression=comp))
for i, g in zip(BIG, grouped([tf.constant(codes_grads(rank)[i]) for i in BIG])):
    out[f"grouped_{i}"] = g.numpy()
codes = tf.function(lambda xs: hvd_aps.tensorflow.allreduce_codes(xs, comp, name="t"))
for i, g in zip(BIG, codes([tf.constant(codes_grads(rank)[i]) for i in BIG])):
    out[f"tape_{i}"] = g.numpy()
out["subgroups"] = np.array(isinstance(hvd_aps.tensorflow.adapter.levels(None).local, hvd_aps.exchange.Subgroup))
np.savez(f"{sys.argv[1]}/levels_tf_rank{rank}.npz", **out)
