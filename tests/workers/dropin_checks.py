"""Run under `horovodrun -np 3 --gloo`: scenarios Horovod's own optimizer tests exercise, each run
twice, with Horovod's Compression.none and with APSCompressor (every gradient as codes). Each
rank saves every run's final parameters (or its error) to OUTDIR/dropin_rank<r>.npz for
tests/test_dropin.py."""
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
from two_heads import STEPS, TwoHeads, save_outcome, sgd

hvd.init(process_sets="dynamic")
rank, out = hvd.rank(), {}


def compressors():
    """(run name, a fresh compression) for each way a scenario runs."""
    return [("stock", lambda: hvd.Compression.none),
            # 4 KiB buckets: a layout of several buckets, launched in its order as they fill
            ("codes", lambda: hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0, bucket_bytes=4096))]


def train(compression, both=False, process_set=hvd.global_process_set, **options):
    """SGD through Horovod's optimizer -> the final parameters, flat."""
    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   process_set=process_set, **options)
    return sgd(model, opt, rank, STEPS, lambda x: model(x, both))


def outcome(run, fn):
    save_outcome(out, run, fn)


alone = hvd.add_process_set([0])          # a set of one rank
pair = hvd.add_process_set([0, 1])        # a set without the last rank
solo = hvd.add_process_set([2])
mine = pair if rank < 2 else solo         # two optimizers on disjoint sets
for run, make in compressors():
    outcome(f"unused_{run}", lambda: train(make(), both=rank == 1))
    outcome(f"alone_{run}", lambda: train(make(), process_set=alone))
    outcome(f"pair_{run}", lambda: train(make(), both=rank == 0, process_set=pair))
    outcome(f"disjoint_{run}", lambda: train(make(), process_set=mine))
    x = torch.from_numpy(np.random.default_rng(rank).normal(size=5000).astype(np.float32))
    comp = make()
    outcome(f"allreduce_pair_{run}",
            lambda: hvd.allreduce(x, compression=comp, name="x", process_set=pair).numpy() if rank < 2 else x.numpy())
    outcome(f"allreduce_alone_{run}",
            lambda: hvd.allreduce(x, compression=comp, name="x", process_set=alone).numpy() if rank == 0 else x.numpy())
# one compressor given to two Horovod optimizers: the second is refused at its first gradient
shared = hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0)
outcome("first_owner", lambda: train(shared))
outcome("second_owner", lambda: train(shared))
# settings that cut other buckets: the layout's agreement names them on every rank
outcome("bucket_bytes_differ", lambda: train(hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0,
                                                                    bucket_bytes=4096 * (1 + rank))))
# a layout's gradient no rank hands over in a step (every rank alike, so Horovod goes on): zeros
for run, make in compressors():
    comp, a, b = make(), torch.full((3000,), 1.0 + rank), torch.full((2000,), 2.0)
    hvd.grouped_allreduce([a, b], compression=comp, name="z")  # the layout: z.0, z.1
    outcome(f"zero_filled_{run}", lambda: hvd.grouped_allreduce([a], compression=comp, name="z")[0].numpy())
hvd.barrier()  # the ranks outside a set wait for its members before it goes
hvd.remove_process_set(pair)
shifted = hvd.add_process_set([1, 2])     # added after another was removed (its id may come again)
for run, make in compressors():
    outcome(f"shifted_{run}", lambda: train(make(), both=rank == 1, process_set=shifted))
np.savez(f"{sys.argv[1]}/dropin_rank{rank}.npz", **out)
hvd.barrier()  # a rank that ends shuts Horovod down for the others
