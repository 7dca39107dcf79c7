"""hvd_aps.ddp: APS codes for torch.distributed DistributedDataParallel, as a DDP comm hook.

    import hvd_aps, hvd_aps.ddp
    ddp.register_comm_hook(hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3)), hvd_aps.ddp.aps_hook)

The bucket goes through the same exchange driver as every Horovod path (hvd_aps.exchange), with
torch.distributed collectives: a Max all_reduce of the metadata, all_to_all_single of the codes,
an all_gather of the reduced ranges (equal sizes: the stages pad each to the longest, a few
bytes), then decode into the bucket; with several ranks on each of several hosts, float32 inside
the host (through shared memory on the CPU, hvd_aps._host_memory; all_to_all and all_gather on
CUDA tensors) and codes only between hosts. Gloo on the CPU; NCCL with CUDA tensors through the
CuPy engine. Importing this module does not import Horovod.
"""
import datetime
import functools
import threading

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from . import _arrays, _device, _host_memory, _metadata, _threads, exchange
from ._stages import Bucket
from ._topology import Topology, launcher_place
from .compressor import APSCompressor
from .config import Path, Wire


class TorchDistributedCollectives(exchange.AsyncEager):
    """torch.distributed collectives on NumPy/CuPy arrays, in `group`, on `device` (the bucket's:
    NCCL needs CUDA tensors, Gloo takes CPU ones). What they receive lands in buffers kept per
    collective name and reused every step (a bucket's float32 slices are tens of MB: fresh pages
    cost more to fault in than the copy into them)."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._received = {}

    def _output(self, name, n, dtype):
        out = self._received.get(name)
        if out is None or out.numel() != n or out.dtype != dtype:
            out = self._received[name] = torch.empty(n, dtype=dtype, device=self.device)
        return out

    def _tensor(self, array):
        return torch.from_dlpack(array).to(self.device)

    def max_allreduce(self, vector, name):
        t = self._tensor(vector)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return _arrays.as_array(t)

    def allreduce(self, values, name):
        t = self._tensor(values)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return _arrays.as_array(t)

    def alltoall_start(self, send, splits, name):
        splits = [int(s) for s in _arrays.to_numpy(splits)]
        sent = self._tensor(send)
        # every rank's part for rank r has the same length, so rank r receives splits[r] from each
        received = self._output(name, splits[self.rank] * self.world, sent.dtype)
        work = dist.all_to_all_single(received, sent, [splits[self.rank]] * self.world, splits, group=self.group,
                                      async_op=True)
        return work, sent, received

    def allgather_start(self, message, name):
        mine = self._tensor(message)
        gathered = self._output(name, mine.numel() * self.world, mine.dtype)
        return dist.all_gather_into_tensor(gathered, mine, group=self.group, async_op=True), mine, gathered

    def wait(self, handle):
        work, _, out = handle  # the input stays referenced until the collective is done
        work.wait()
        return _arrays.as_array(out)


def group_levels(process_group, hierarchical, timeout: float) -> tuple:
    """(world, cross, local, host memory): a private copy of `process_group` (so the exchange's
    collectives never interleave with DDP's own), and with two levels this rank's host and cross
    groups and, where the ranks of a host share /dev/shm, the HostMemory that carries float32
    between them on the CPU (else cross is world, local and host memory None), made alike on
    every rank, each collective waiting `timeout` seconds at most (the groups' own timeout).
    Collective: every rank of the process group calls it together."""
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    wait = datetime.timedelta(seconds=timeout)
    world = dist.new_group(ranks, timeout=wait)
    if hierarchical is False or len(ranks) == 1:
        return world, world, None, None
    places = [None] * len(ranks)
    dist.all_gather_object(places, (*launcher_place(), *_host_memory.place()), group=world)
    topology = Topology.from_places([p[:2] for p in places])
    if not topology.two_levels(hierarchical):
        return world, world, None, None
    me = dist.get_rank(world)
    groups = {g: dist.new_group([ranks[r] for r in g], timeout=wait) for g in topology.groups()}
    memory = _host_memory.connect(topology, places, me, lambda obj: _all_gather_object(obj, world), timeout=timeout)
    return world, groups[topology.cross_group(me)], groups[topology.local_group(me)], memory


def _all_gather_object(obj, group) -> list:
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def levels_on(groups: tuple, device) -> exchange.Levels:
    """exchange.Levels over (world, cross, local, host memory), for tensors on `device`: the host
    level through shared memory for CPU tensors where there is one."""
    memory = groups[3]
    world, cross, local = (None if g is None else TorchDistributedCollectives(g, device) for g in groups[:3])
    if memory is not None and torch.device(device).type == "cpu":
        local = memory
    return exchange.Levels(world, cross if groups[1] is not groups[0] else world, local)


class APSState:
    """What aps_hook keeps between steps, grouped as torch's PowerSGDState is.

    Hyperparameters: `compressor` (an hvd_aps.APSCompressor sending codes: its configuration,
    exchange state and stats apply), `process_group` (DDP's; None for the default group).
    Internal state: LANES lanes, each a private copy of the process group (with two levels, the
    host and cross groups too) and one communication thread: bucket b goes to lane b % LANES, so
    one bucket's encoding overlaps another's transfers, every lane's collectives are issued in
    bucket order on every rank, and none interleave with DDP's own; `close()` stops the threads
    and destroys the groups. A step (hvd_aps.exchanger) ends when its last bucket is handed over
    and done: it commits (residuals, step counts), or rolls back if a bucket raised.
    Stats: `compressor.bytes_sent`, `compressor.totals()`, `buckets_exchanged`.
    """

    LANES = 2

    def __init__(self, compressor: APSCompressor, process_group=None):
        if not isinstance(compressor, APSCompressor) or compressor.config.wire is not Wire.CODES:
            raise TypeError(f"APSState needs an hvd_aps.APSCompressor sending codes, got {compressor!r}")
        if not dist.is_initialized():
            raise RuntimeError("APSState needs torch.distributed initialised (dist.init_process_group)")
        compressor.claim("an hvd_aps.ddp.APSState")
        # a configuration that differs between ranks fails here, on every rank, not in backward
        # (where torch reports a hook's error as "Unable to cast ... to Tensor")
        _metadata.check_same_settings(_all_gather_object(compressor.config.settings(), process_group))
        self.compressor, self.process_group = compressor, process_group
        self.buckets_exchanged = 0
        self._lock = threading.Lock()
        self._seen, self._levels, self._keys, self._buckets = set(), {}, {}, {}
        self._lanes = [(group_levels(process_group, compressor.config.hierarchical, compressor.config.timeout),
                        _threads.pool(1, f"hvd_aps_ddp{lane}"))
                       for lane in range(self.LANES)]

    def lane(self, index: int, device) -> tuple:
        """(Levels for tensors on `device`, thread) of bucket `index`'s lane (one Levels per lane
        and device, kept: its collectives hold the receive buffers)."""
        if not self._lanes:
            raise RuntimeError("this APSState was closed")
        groups, thread = self._lanes[index % self.LANES]
        key = (index % self.LANES, str(device))
        if key not in self._levels:
            self._levels[key] = levels_on(groups, device)
        return self._levels[key], thread

    def bucket(self, bucket: dist.GradBucket) -> Bucket:
        """The exchange's Bucket for DDP's: its parameters' names and sizes, made once per bucket
        index and set of parameters (DDP rebuilds its buckets after the first step). Names, for
        residuals and stochastic rounding: the parameters' order of first appearance in the
        buckets, which is DDP's first step's bucket order in every process that builds the same
        model (a bucket's index and place do not name a parameter from one step, or one process,
        to the next)."""
        parameters, index = bucket.parameters(), bucket.index()
        ids = tuple(map(id, parameters))
        with self._lock:
            made = self._buckets.get(index)
            if made is None or made[0] != ids:
                keys = [self._keys.setdefault(i, f"ddp.param{len(self._keys)}") for i in ids]
                name = f"ddp.bucket{index}"
                made = self._buckets[index] = ids, Bucket.whole(name, keys, _labels(name, len(ids)),
                                                                 [p.numel() for p in parameters])
            return made[1]

    def opened(self, index: int) -> None:
        """Bucket `index` starts. Seen before in this step: the step never handed over its last
        bucket (backward raised after this one), so it is given up and this bucket opens the next."""
        with self._lock:
            again = index in self._seen
            self._seen = {index} | (set() if again else self._seen)
        if again:
            self.compressor.exchanger.abort_step()

    def handed_over(self, last: bool) -> None:
        """A bucket's exchange is under way; after the step's last, the step ends once all are done."""
        if last:
            with self._lock:
                self._seen = set()
            self.compressor.exchanger.end_step()

    def counted(self) -> None:
        with self._lock:
            self.buckets_exchanged += 1

    def close(self) -> None:
        """Stop the lanes' threads and destroy their process groups."""
        lanes, self._lanes = self._lanes, []
        self._levels.clear()
        for groups, thread in lanes:
            thread.shutdown(wait=True)
            for group in {id(g): g for g in groups[:3] if g is not None}.values():
                dist.destroy_process_group(group)
            if groups[3] is not None:
                groups[3].close()

    def __enter__(self) -> "APSState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        """Pickled as torch's hook states are: without process groups or threads (made anew when
        unpickled, on the default group: every rank unpickles together)."""
        return {"compressor": self.compressor, "buckets_exchanged": self.buckets_exchanged}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(saved["compressor"])
        self.buckets_exchanged = saved["buckets_exchanged"]


def aps_hook(state: APSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket's gradients across ranks, sending APS codes.

    1. Every gradient of the bucket becomes a float32 flat (a view where the bucket is float32).
    2. The exchange runs on one of the state's lanes, so backward goes on.
    3. The averaged gradients land in the bucket's buffer (decoded straight into it where it is
       float32; fp16/bf16 buckets come back in their dtype), and the returned Future completes
       with it. A gradient with NaN/Inf on any rank comes back all NaN on every rank, so a
       GradScaler skips the step.

    Example::

        state = hvd_aps.ddp.APSState(hvd_aps.APSCompressor(hvd_aps.e4m3))
        ddp_model.register_comm_hook(state, hvd_aps.ddp.aps_hook)
    """
    buffer, index, exchanger = bucket.buffer(), bucket.index(), state.compressor.exchanger
    state.opened(index)
    spec = state.bucket(bucket)
    native = exchanger.native_dtype()
    if native is not None:
        future = _native(state, bucket, spec, native)
        state.handed_over(bucket.is_last())
        return future
    # on CUDA: the lane's own stream, after what DDP's stream (the one it calls the hook on) has
    # queued, and a Future whose completion DDP's stream waits for as an event, not the host
    place = _device.branch(_device.place_of(buffer), ("ddp", index % state.LANES))
    future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    levels, thread = state.lane(index, buffer.device)

    def run():
        with _device.entered(place):
            stages = exchanger.stages(levels.cross.world, levels.cross.rank)
            # the bucket's buffer is its gradients end to end: a float32 one is read and decoded
            # into in place (each element read before its result is written), others through a
            # float32 copy
            in_place = buffer.dtype == torch.float32
            array = _arrays.as_array(buffer.view(-1) if in_place else buffer.view(-1).to(torch.float32))
            mean = exchange.run(stages, spec, array, levels, out=array, average=True)
            if not in_place:
                buffer.view(-1).copy_(torch.from_dlpack(mean))
        state.counted()
        return buffer

    def settle(done):
        error = done.exception()
        try:
            with _device.entered(place):  # the Future's event is recorded on the exchange's stream
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result())
        except BaseException as failed:  # whatever happens, DDP's wait on the Future ends
            if not future.done():
                future.set_exception(error or failed)

    exchanger.submit(run, executor=thread).add_done_callback(settle)  # after the step has counted it done
    state.handed_over(bucket.is_last())
    return future


@functools.lru_cache(maxsize=None)
def _labels(name: str, count: int) -> tuple:
    """A bucket's gradients' names in the stats (made once per bucket)."""
    return tuple(f"{name}[{i}]" for i in range(count))


_NATIVE_HOOKS = {Path.FLOAT32: default_hooks.allreduce_hook, Path.FLOAT16: default_hooks.fp16_compress_hook,
                 Path.BFLOAT16: default_hooks.bf16_compress_hook}


def _native(state: APSState, bucket: dist.GradBucket, spec: Bucket,
            fallback: Path) -> torch.futures.Future[torch.Tensor]:
    """policy="auto" sends this bucket through the framework's own allreduce in `fallback`:
    torch's own hook for that dtype (in place, no copies), in flight in the step and counted as
    every native exchange is."""
    exchanger = state.compressor.exchanger

    def settle(done):
        value = done.value()
        world = dist.get_world_size(state.process_group)
        exchanger.count_native(spec.keys, zip(spec.labels, spec.sizes), fallback, world)
        state.counted()
        return value

    future = _NATIVE_HOOKS[fallback](state.process_group, bucket).then(settle)
    exchanger.track(future)
    return future
