"""hvd_aps.fsdp: APS codes in FSDP2's gradient reduce-scatter (torch >= 2.9).

    model = ...                                   # fully_shard() applied to its blocks and itself
    hvd_aps.fsdp.apply(model, hvd_aps.APSCompressor(hvd_aps.e4m3))

FSDP2 calls `FSDPModule.set_custom_reduce_scatter`'s object once per module and backward with a
flat input laid out (world, -1), row r for rank r. `APSReduceScatter` sends it as codes through
hvd_aps.exchange.reduce_scatter (hvd_aps._scatter): each rank sends (N-1)/N of its codes once,
half an allreduce's traffic, and averages in float32 (FSDP is told to sum and not to divide).

Two levels (HSDP's shape: parameters sharded inside a host, replicated across hosts): shard the
model over this host's ranks only (`host_mesh()`), and `apply(model, compressor,
replicate_group=...)` leaves FSDP's reduce-scatter inside the host native (float32) and sends the
host-summed shard across hosts as codes, from FSDP's all-reduce hook.

Each module's exchange is its own step of the compressor's state: it commits when it ends, and
one that raises leaves the state as it was. On CUDA tensors the CuPy engine runs the codec.
"""
import os
import socket

import torch
import torch.distributed as dist

from . import _arrays, exchange
from ._scatter import ScatterExchange
from ._stages import Bucket
from ._topology import Topology
from .compressor import APSCompressor
from .ddp import TorchDistributedCollectives

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # torch before FSDP2's public API
    FSDPModule, ReduceScatter = None, object

MIN_TORCH = "2.9"  # FSDPModule.set_custom_reduce_scatter


class APSReduceScatter(ReduceScatter):
    """FSDP2's ReduceScatter, sending APS codes: averages (one float32 rounding) into the output
    in its dtype (a MixedPrecisionPolicy's reduce_dtype comes back as it went)."""

    def __init__(self, compressor: APSCompressor, name: str):
        self.compressor, self.name = compressor, name
        self._collectives = {}  # per (group, device): they keep the receive buffers

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"APSReduceScatter averages itself: FSDP must pass ReduceOp.SUM (use hvd_aps.fsdp.apply, "
                             f"which sets set_force_sum_reduction_for_comms and set_gradient_divide_factor), got {op}")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = (id(group), str(input_tensor.device))
        if key not in self._collectives:
            self._collectives[key] = TorchDistributedCollectives(group, input_tensor.device)
        coll = self._collectives[key]
        stages = ScatterExchange(self.compressor.config, self.compressor.state, self.compressor.recorder, world, rank)
        rows = _arrays.as_array(input_tensor.detach().to(torch.float32).reshape(world, -1))
        out = torch.empty(output_tensor.numel(), dtype=torch.float32, device=output_tensor.device)
        with _step(self.compressor):
            exchange.reduce_scatter(stages, self.name, rows, coll, _arrays.as_array(out), world)
        output_tensor.copy_(out.view(output_tensor.shape))
        return None


class CrossHostHook:
    """FSDP2's all-reduce hook for two levels: the host-summed shard averaged across hosts over
    `group` as codes (hvd_aps.exchange.run), in place, divided by every rank's count."""

    def __init__(self, compressor: APSCompressor, name: str, group: dist.ProcessGroup, world: int):
        self.compressor, self.name, self.group, self.world = compressor, name, group, world

    def __call__(self, reduce_output: torch.Tensor) -> None:
        coll = TorchDistributedCollectives(self.group, reduce_output.device)
        stages = self.compressor.stages(coll.world, coll.rank, dist.get_rank())
        flat = reduce_output.detach().reshape(-1)
        values = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
        bucket = Bucket.whole(self.name, [self.name], [self.name], [values.numel()])
        with _step(self.compressor):
            exchange.run(stages, bucket, [_arrays.as_array(values)], exchange.Levels.flat(coll),
                         outs=[_arrays.as_array(values)], divisor=self.world)
        if values is not flat:
            flat.copy_(values)


class _step:
    """One exchange as one step of the compressor's state: committed, or rolled back if it raised."""

    def __init__(self, compressor):
        self.state = compressor.state

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        (self.state.commit if kind is None else self.state.rollback)()
        return False


def apply(model: torch.nn.Module, compressor: APSCompressor, replicate_group: dist.ProcessGroup = None) -> int:
    """Send every FSDPModule of `model`'s gradients as APS codes -> the number of modules set.

    replicate_group None: codes in the reduce-scatter itself (APSReduceScatter). A group (the
    ranks on other hosts holding this rank's shard, as host_mesh() gives it): the model is sharded
    inside the host, whose reduce-scatter stays FSDP's own; the shard crosses hosts as codes
    (CrossHostHook). Either way FSDP sums and hvd_aps averages, over every rank."""
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"hvd_aps.fsdp needs torch >= {MIN_TORCH} (FSDPModule.set_custom_reduce_scatter); "
                           f"this is torch {torch.__version__}")
    if not isinstance(compressor, APSCompressor) or compressor.config.wire != "codes":
        raise TypeError(f"hvd_aps.fsdp needs an hvd_aps.APSCompressor sending codes, got {compressor!r}")
    modules = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDPModule in this model: call torch.distributed.fsdp.fully_shard on it first")
    world = dist.get_world_size()
    for name, module in modules:
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
        if replicate_group is None:
            module.set_custom_reduce_scatter(APSReduceScatter(compressor, f"fsdp.{name}"))
        else:
            module.set_all_reduce_hook(CrossHostHook(compressor, f"fsdp.{name}", replicate_group, world))
    return len(modules)


def host_mesh(device_type: str = "cpu"):
    """(this host's DeviceMesh for fully_shard, the replicate group for apply()): the ranks of every
    host (torchrun's GROUP_RANK and LOCAL_RANK, else the hostname) sharding among themselves,
    replicated across hosts. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (os.environ.get("GROUP_RANK") or socket.gethostname(),
                                    int(os.environ.get("LOCAL_RANK", "0"))))
    topology = Topology.from_places(places)
    if not topology.equal:
        raise ValueError(f"host_mesh needs the same number of ranks on every host, got {[len(h) for h in topology.hosts]}")
    if any(list(h) != list(range(h[0], h[0] + len(h))) for h in topology.hosts):
        raise ValueError("host_mesh needs each host's ranks numbered consecutively, as torchrun numbers them")
    mesh = init_device_mesh(device_type, (len(topology.hosts), len(topology.hosts[0])),
                            mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh["replicate"].get_group()
