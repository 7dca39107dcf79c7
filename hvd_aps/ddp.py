"""hvd_aps.ddp: APS codes for torch.distributed DistributedDataParallel, as a DDP comm hook.

    import hvd_aps, hvd_aps.ddp
    ddp.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3)), hvd_aps.ddp.aps_hook)

The bucket goes through the same exchange driver as every Horovod path (hvd_aps.exchange), with
torch.distributed collectives: a Max all_reduce of the metadata, all_to_all_single of the code
shards, an all_gather of the reduced shards (equal sizes: hvd_aps.wire pads each to the longest,
a few bytes), then decode into the bucket. Gloo on the CPU; NCCL with CUDA tensors through the
CuPy engine. Importing this module does not import Horovod.
"""
import concurrent.futures

import torch
import torch.distributed as dist

from . import _arrays, exchange
from .compressor import APSCompressor


class TorchDistributedCollectives(exchange.AsyncEager):
    """torch.distributed collectives on NumPy/CuPy arrays, in `group`, on `device` (the bucket's:
    NCCL needs CUDA tensors, Gloo takes CPU ones)."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _tensor(self, array):
        return torch.from_dlpack(array).to(self.device)

    def max_allreduce(self, vector, name):
        t = self._tensor(vector)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().numpy()

    def alltoall_start(self, send, splits, name):
        splits = [int(s) for s in _arrays.to_numpy(splits)]
        # every rank's shard r has the same length, so rank r receives splits[r] bytes from each
        received = torch.empty(splits[self.rank] * self.world, dtype=torch.uint8, device=self.device)
        sent = self._tensor(send)
        work = dist.all_to_all_single(received, sent, [splits[self.rank]] * self.world, splits, group=self.group,
                                      async_op=True)
        return work, sent, received

    def allgather_start(self, message, name):
        mine = self._tensor(message)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        return dist.all_gather(parts, mine, group=self.group, async_op=True), mine, parts

    def wait(self, handle):
        work, _, out = handle  # the input stays referenced until the collective is done
        work.wait()
        return _arrays.as_array(torch.cat(out) if isinstance(out, list) else out)



class APSState:
    """What aps_hook keeps between steps.

    Hyperparameters: `compressor` (an hvd_aps.APSCompressor sending codes; its format, rounding and
    scaling apply), `process_group` (DDP's; None for the default group).
    Internal state: LANES private copies of the process group, each with one communication
    thread: bucket b goes to lane b % LANES, so one bucket's encoding overlaps another's
    transfers, every lane's collectives are issued in bucket order on every rank, and none
    interleave with DDP's own (find_unused_parameters' bitmap, bucket rebuilds). The exchange's
    buffers are keyed by bucket index and reallocate when DDP rebuilds its buckets after the
    first step.
    Stats: `compressor.bytes_sent`, `compressor.totals()`, `buckets_exchanged`.
    """

    LANES = 2

    def __init__(self, compressor, process_group=None):
        if not isinstance(compressor, APSCompressor) or compressor.config.wire != "codes":
            raise TypeError(f"APSState needs an hvd_aps.APSCompressor sending codes, got {compressor!r}")
        if not dist.is_initialized():
            raise RuntimeError("APSState needs torch.distributed initialised (dist.init_process_group)")
        self.compressor = compressor
        self.process_group = process_group
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.lanes = [(dist.new_group(ranks, use_local_synchronization=True),
                       concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hvd_aps_ddp{lane}"))
                      for lane in range(self.LANES)]
        self.buckets_exchanged = 0


def aps_hook(state, bucket):
    """DDP comm hook: average the bucket's gradients across ranks, sending APS codes.

    1. Every gradient of the bucket becomes a float32 flat (a view where the bucket is float32).
    2. The exchange runs on one of the state's communication lanes, so backward goes on.
    3. The averaged gradients land in the bucket's buffer (decoded straight into it where it is
       float32; fp16/bf16 buckets come back in their dtype), and the returned Future completes
       with it. A gradient with NaN/Inf on any rank comes back all NaN on every rank, so a
       GradScaler skips the step.

    Example::

        state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3))
        ddp_model.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    """
    buffer, grads = bucket.buffer(), bucket.gradients()
    future = torch.futures.Future()

    group, thread = state.lanes[bucket.index() % len(state.lanes)]

    def run():
        coll = TorchDistributedCollectives(group, buffer.device)
        stages = state.compressor.stages(coll.world, coll.rank)
        flats = [_arrays.as_array(g.detach().to(torch.float32).reshape(-1)) for g in grads]
        # float32 buckets take the sums in place (the flats are read only before the sums are
        # written); the buffer is the bucket's gradients end to end
        outs = ([_arrays.as_array(part) for part in buffer.view(-1).split([g.numel() for g in grads])]
                if buffer.dtype == torch.float32 else None)
        means = exchange.run(stages, flats, coll, f"ddp.bucket{bucket.index()}", outs=outs, average=True)
        if outs is None:
            buffer.copy_(torch.cat([torch.from_dlpack(mean) for mean in means]))
        state.buckets_exchanged += 1
        return buffer

    def settle(done):
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(done.result())

    thread.submit(run).add_done_callback(settle)
    return future
