"""Run under `horovodrun -np 3 --gloo`: scenarios Horovod's own optimizer tests exercise, each run
twice, with Horovod's Compression.none and with APSCompressor (every gradient as codes). Each
rank saves every run's final parameters (or its error) to OUTDIR/dropin_rank<r>.npz for
tests/test_dropin.py. Last, ranks that disagree (rank 1 builds another model), with codes only
(Compression.none waits for ever: docs/api.md), then Horovod shut down and started again, and
the same model on every rank trains."""
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

import hvd_aps
from common import DISAGREE_TIMEOUT
from two_heads import STEPS, Deeper, SparseTable, TwoHeads, loss, plain_step, save_outcome, sgd

CLIP = 0.05  # gradient norm clipped to: below this model's first gradients, so clipping acts

hvd.init(process_sets="dynamic")
rank, out = hvd.rank(), {}


def compressors():
    """(run name, a fresh compression) for each way a scenario runs."""
    return [("stock", lambda: hvd.Compression.none),
            # 4 KiB buckets: a layout of several buckets, launched in its order as they fill
            ("codes", lambda: hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0, bucket_bytes=4096))]


def train(compression, both=False, process_set=hvd.global_process_set, model=None, take_step=plain_step,
          **options):
    """SGD through Horovod's optimizer (of `model`, a TwoHeads by default, each step taken by
    `take_step`) -> the final parameters, flat."""
    model = model or TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   process_set=process_set, **options)
    forward = model if isinstance(model, SparseTable) else lambda x: model(x, both)
    return sgd(model, opt, rank, STEPS, forward, take_step)


def clipped_step(opt, forward, x, y):
    """Horovod's pattern for clipping: synchronize(), clip, then step() inside skip_synchronize()."""
    opt.zero_grad()
    loss(forward, x, y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], CLIP)
    with opt.skip_synchronize():
        opt.step()


def accumulated_step(opt, forward, x, y):
    """backward_passes_per_step=2: a backward pass on each half of the batch, then one step."""
    opt.zero_grad()
    for half in (slice(0, len(x) // 2), slice(len(x) // 2, None)):
        loss(forward, x[half], y[half]).backward()
    opt.step()


def outcome(run, fn):
    save_outcome(out, run, fn)


def timed_outcome(run, fn):
    """outcome(), and the seconds it took (run + "_seconds")."""
    start = time.monotonic()
    outcome(run, fn)
    out[f"{run}_seconds"] = np.array(time.monotonic() - start)


def disagree(compression):
    """Rank 1 trains a Deeper, the others a TwoHeads: its first gradient is one no other rank
    has, so it waits in Horovod's negotiation of that gradient, for ever."""
    return train(compression, model=Deeper() if rank == 1 else TwoHeads())


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
    # Horovod's optimizer's options, and its lifecycle
    outcome(f"num_groups_{run}", lambda: train(make(), num_groups=2))
    outcome(f"clipped_{run}", lambda: train(make(), take_step=clipped_step))
    outcome(f"accumulated_{run}", lambda: train(make(), take_step=accumulated_step, backward_passes_per_step=2))
    outcome(f"sparse_{run}", lambda: train(make(), model=SparseTable()))  # Horovod's sparse allreduce
    outcome(f"sparse_as_dense_{run}", lambda: train(make(), model=SparseTable(), sparse_as_dense=True))
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
# ranks that disagree: the ranks that wait in hvd_aps's agreement of the buckets raise after
# DISAGREE_TIMEOUT, then shut Horovod down, as their script's end would, which ends rank 1's wait
# in Horovod's own negotiation
timed_outcome("disagree_codes", lambda: disagree(hvd_aps.APSCompressor(hvd_aps.e4m3, min_elements=0,
                                                                       timeout=DISAGREE_TIMEOUT)))
hvd.shutdown()
hvd.init()  # hvd.shutdown() then hvd.init() in one process, and training goes on
for run, make in compressors():
    outcome(f"reinit_{run}", lambda: train(make()))
np.savez(f"{sys.argv[1]}/dropin_rank{rank}.npz", **out)
hvd.barrier()  # a rank that ends shuts Horovod down for the others
