"""hvd_aps.fsdp: APS codes in FSDP2's gradient reduce-scatter and parameter all-gather (torch >= 2.9).

    model = ...                                   # fully_shard() applied to its blocks and itself
    hvd_aps.fsdp.apply(model, hvd_aps.APSCompressor(hvd_aps.e4m3), params=hvd_aps.e4m3)

`APSReduceScatter` (set_custom_reduce_scatter) sends FSDP's (world, -1) input as codes through
hvd_aps.exchange.reduce_scatter: (N-1)/N of a rank's codes once, averaged in float32 (FSDP is told
to sum). HSDP's shape: shard over this host (`host_mesh()`), `apply(..., replicate_group=...)`:
FSDP's float32 inside the host, the host-summed shard in codes from its all-reduce hook. A
backward is one step of the compressor's state, committed when autograd's backward ends (rolled
back if an exchange raised); each call completes before it returns None. `APSAllGather`
(`params=`, set_custom_all_gather) encodes this rank's shard, each block at its own power of two
(hvd_aps._owned); every rank decodes the gathered codes into the unsharded copy alike, which alone
is rounded, anew each gather. Gathers over another group, or of mixed dtypes, go as FSDP sends them.
"""
import contextlib
import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import _arrays, _device, _metadata, exchange
from ._codes_collectives import CODED_DTYPES, BlockGather, gather_into
from ._owned import BlockCodes
from ._stages import Bucket
from ._topology import Topology, launcher_place
from .compressor import APSCompressor
from .ddp import TorchDistributedCollectives, _all_gather_object
from .config import Path, Wire
from .formats import FloatFormat

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # torch before FSDP2's public API
    FSDPModule, AllGather, ReduceScatter = None, object, object

MIN_TORCH = "2.9"  # FSDPModule.set_custom_reduce_scatter and set_custom_all_gather


class APSReduceScatter(ReduceScatter):
    """FSDP2's ReduceScatter, sending APS codes: averages (one float32 rounding) into the output
    in its dtype (a MixedPrecisionPolicy's reduce_dtype comes back as it went). With
    policy="auto", FSDP's own reduce-scatter in the compressor's `fallback` dtype where the
    schedule chose it, or times it."""

    def __init__(self, compressor: APSCompressor, name: str):
        self.compressor, self.name = compressor, name
        self._exchanges = {}  # per (group, device): collectives (they keep the receive buffers), stages

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"APSReduceScatter averages itself: FSDP must pass ReduceOp.SUM (use hvd_aps.fsdp.apply, "
                             f"which sets set_force_sum_reduction_for_comms and set_gradient_divide_factor), got {op}")
        coll, stages = self._exchange(group, input_tensor.device)
        self.compressor.state.schedule.unchunked(self.name)
        # on CUDA, everything on the stream FSDP called on (its reduce-scatter stream), where it
        # reads the output next
        with _device.entered(_device.place_of(input_tensor)):
            rows = input_tensor.detach().to(torch.float32).reshape(coll.world, -1)
            out = torch.empty(output_tensor.numel(), dtype=torch.float32, device=output_tensor.device)
            with _backward_step(self.compressor):
                native = self.compressor.exchanger.native_dtype()
                if native is not None:
                    self._native(rows, out, group, native)
                else:
                    exchange.reduce_scatter(stages, self.name, _arrays.as_array(rows), coll, _arrays.as_array(out),
                                            coll.world)
            output_tensor.copy_(out.view(output_tensor.shape))
        return None

    def _exchange(self, group, device) -> tuple:
        key = (id(group), str(device))
        if key not in self._exchanges:
            coll = TorchDistributedCollectives(group, device)
            self._exchanges[key] = coll, self.compressor.exchanger.scatter_stages(coll.world, coll.rank)
        return self._exchanges[key]

    def _native(self, rows: torch.Tensor, out: torch.Tensor, group, fallback: Path) -> None:
        """FSDP's own reduce-scatter of the rows on the native path `fallback`, averaged in float32,
        counted as a passed-through tensor."""
        dtype = getattr(torch, fallback.value)
        world = rows.shape[0]
        shard = torch.empty(out.numel(), dtype=dtype, device=out.device)
        dist.reduce_scatter_tensor(shard, rows.to(dtype).reshape(-1), op=dist.ReduceOp.SUM, group=group)
        torch.div(shard.to(torch.float32), world, out=out)
        self.compressor.exchanger.count_native([self.name], [(self.name, rows.numel())], fallback, world,
                                               exchange.Native.REDUCE_SCATTER)


class APSAllGather(AllGather):
    """FSDP2's AllGather, sending APS codes: this rank's shard encoded (`codes`: a BlockCodes,
    each block at its own power of two), every rank's codes gathered and decoded into the output
    in its dtype (float32, bfloat16 or float16; any other gathers as FSDP sends it). `bytes_sent`:
    what this rank sent in its gathers."""

    def __init__(self, codes: BlockCodes, name: str):
        self.codes, self.name = codes, name
        self._gather = BlockGather(codes)
        self._group_size = None  # the module's shard group's, from the first gather (the forward's)

    @property
    def bytes_sent(self) -> int:
        return self._gather.bytes_sent

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        self._group_size = self._group_size or world
        if output_tensor.dtype not in CODED_DTYPES or world != self._group_size:
            gather_into(output_tensor, input_tensor, group=group)
        else:
            self._gather(input_tensor, group, output_tensor)
        return None


class CrossHostHook:
    """FSDP2's all-reduce hook for two levels: the host-summed shard averaged across hosts over
    `group` as codes (hvd_aps.exchange.run), in place, divided by every rank's count."""

    def __init__(self, compressor: APSCompressor, name: str, group: dist.ProcessGroup, world: int):
        self.compressor, self.name, self.group, self.world = compressor, name, group, world
        self._collectives = {}  # per device: they keep the receive buffers

    def __call__(self, reduce_output: torch.Tensor) -> None:
        device = str(reduce_output.device)
        if device not in self._collectives:
            self._collectives[device] = TorchDistributedCollectives(self.group, reduce_output.device)
        coll = self._collectives[device]
        stages = self.compressor.exchanger.stages(coll.world, coll.rank, dist.get_rank())
        flat = reduce_output.detach().reshape(-1)
        values = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
        bucket = Bucket.whole(self.name, [self.name], [self.name], [values.numel()])
        with _backward_step(self.compressor), _device.entered(_device.place_of(reduce_output)):
            array = _arrays.as_array(values)
            exchange.run(stages, bucket, array, exchange.Levels.flat(coll), out=array, divisor=self.world)
        if values is not flat:
            flat.copy_(values)


class _BackwardStep:
    """One step of an exchanger per autograd backward: the first exchange of a backward queues
    the step's end on autograd's engine (after FSDP's own final callback, which may still
    reduce). An exchange that raises gives the step up at once (Exchanger.exchange: a failed
    backward runs no final callbacks) and the callback already queued does nothing. An exchange
    outside any backward is a step by itself."""

    def __init__(self, exchanger):
        self.exchanger, self._open, self._generation = exchanger, False, 0

    @contextlib.contextmanager
    def exchange(self):
        inside = self._open or self._open_step()
        try:
            with self.exchanger.exchange():
                yield
        except BaseException:
            self._open, self._generation = False, self._generation + 1
            raise
        if not inside:
            self.exchanger.end_step()

    def _open_step(self) -> bool:
        generation = self._generation
        try:
            Variable._execution_engine.queue_callback(lambda: self._end(generation))
        except RuntimeError:  # "Final callbacks can only be installed during backward pass"
            return False
        self._open = True
        return True

    def _end(self, generation: int) -> None:
        if self._open and generation == self._generation:
            self._open, self._generation = False, generation + 1
            self.exchanger.end_step()


_BACKWARD_STEPS = weakref.WeakKeyDictionary()  # exchanger -> its _BackwardStep


def _backward_step(compressor: APSCompressor):
    """The context of one exchange inside the compressor's step of the current backward."""
    exchanger = compressor.exchanger
    steps = _BACKWARD_STEPS.get(exchanger)
    if steps is None:
        steps = _BACKWARD_STEPS[exchanger] = _BackwardStep(exchanger)
    return steps.exchange()


_GATHERS = weakref.WeakKeyDictionary()  # model -> the APSAllGathers apply() set on its modules


def apply(model: torch.nn.Module, compressor: Optional[APSCompressor] = None,
          replicate_group: Optional[dist.ProcessGroup] = None,
          params: Union[BlockCodes, FloatFormat, str, None] = None) -> int:
    """Send every FSDPModule of `model`'s gradients and (with `params`) parameters as APS codes ->
    the number of modules set.

    compressor: the gradients' codes (None: FSDP's own reduce-scatter). replicate_group None: codes
    in the reduce-scatter itself (APSReduceScatter). A group (the ranks on other hosts holding
    this rank's shard, as host_mesh() gives it): the model is sharded inside the host, whose
    reduce-scatter stays FSDP's own; the shard crosses hosts as codes (CrossHostHook). Either way
    FSDP sums and hvd_aps averages, over every rank.
    params: the parameters' all-gather in codes (APSAllGather), a BlockCodes or a format (each
    block of 2048 values at its own scale); None: FSDP's own all-gather. gather_bytes(model) counts
    what they sent."""
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(f"hvd_aps.fsdp needs torch >= {MIN_TORCH} (FSDPModule.set_custom_reduce_scatter and "
                           f"set_custom_all_gather); this is torch {torch.__version__}")
    if compressor is None and params is None:
        raise ValueError("hvd_aps.fsdp.apply needs a compressor (the gradients' codes), params (the parameters' "
                         "codes) or both")
    if compressor is not None and (not isinstance(compressor, APSCompressor) or compressor.config.wire is not Wire.CODES):
        raise TypeError(f"hvd_aps.fsdp needs an hvd_aps.APSCompressor sending codes, got {compressor!r}")
    if compressor is None and replicate_group is not None:
        raise ValueError("replicate_group sends the gradients across hosts as codes: it needs a compressor")
    codes = None if params is None else BlockCodes.parse(params)
    modules = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDPModule in this model: call torch.distributed.fsdp.fully_shard on it first")
    if codes is not None:  # checked before anything is set: a refusal leaves the model as it was
        _metadata.check_same_settings(_all_gather_object({"params": str(codes.fmt), "params block": codes.block},
                                                         None))
    if compressor is not None:
        _set_gradients(modules, compressor, replicate_group)
    if codes is not None:
        _GATHERS[model] = _GATHERS.get(model, []) + _set_parameters(modules, codes)
    return len(modules)


def _set_gradients(modules: list, compressor: APSCompressor, replicate_group) -> None:
    _metadata.check_same_settings(_all_gather_object(compressor.config.settings(), None))
    compressor.claim("a model given to hvd_aps.fsdp.apply")
    world = dist.get_world_size()
    for name, module in modules:
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
        if replicate_group is None:
            module.set_custom_reduce_scatter(APSReduceScatter(compressor, f"fsdp.{name}"))
        else:
            module.set_all_reduce_hook(CrossHostHook(compressor, f"fsdp.{name}", replicate_group, world))


def _set_parameters(modules: list, codes: BlockCodes) -> list:
    """An APSAllGather on every module (FSDP calls it where the module gathers parameters of its
    own)."""
    gathers = []
    for name, module in modules:
        gathers.append(APSAllGather(codes, f"fsdp.{name}"))
        try:
            module.set_custom_all_gather(gathers[-1])
        except ValueError as err:  # FSDP refuses a module with parameters on more than one mesh
            raise ValueError(f"hvd_aps.fsdp.apply(params=...): FSDP2 refuses a custom all-gather on {name}: "
                             f"{err}") from err
    return gathers


def gather_bytes(model: torch.nn.Module) -> int:
    """The bytes this rank sent in the codes all-gathers apply(params=...) set on `model`."""
    return sum(g.bytes_sent for g in _GATHERS.get(model, ()))


def host_mesh(device_type: str = "cpu"):
    """(this host's DeviceMesh for fully_shard, the replicate group for apply()): the ranks of every
    host sharding among themselves, replicated across hosts (hsdp_mesh()'s two dimensions).
    Collective: every rank calls it."""
    mesh = hsdp_mesh(device_type)
    return mesh["shard"], mesh["replicate"].get_group()


def hsdp_mesh(device_type: str = "cpu"):
    """The 2-D DeviceMesh ("replicate", "shard") of this job's hosts: hosts by their ranks
    (hvd_aps._topology.launcher_place: torchrun's or Slurm's numbering, else the hostname).
    fully_shard(model, mesh=...) on it is torch's own HSDP (float32 across hosts), the peer of
    host_mesh() with apply(). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, launcher_place())
    topology = Topology.from_places(places)
    if not topology.equal:
        raise ValueError(f"an HSDP mesh needs the same number of ranks on every host, "
                         f"got {[len(h) for h in topology.hosts]}")
    if any(list(h) != list(range(h[0], h[0] + len(h))) for h in topology.hosts):
        raise ValueError("an HSDP mesh needs each host's ranks numbered consecutively, as torchrun numbers them")
    return init_device_mesh(device_type, (len(topology.hosts), len(topology.hosts[0])),
                            mesh_dim_names=("replicate", "shard"))
