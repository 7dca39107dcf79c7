"""The three collectives model parallelism runs, on torch tensors of one process group, in codes:
a sum (hvd_aps.exchange.run: agreed APS shifts, an exact float32 sum at each shard's owner, one
rounding), a reduce-scatter (hvd_aps.exchange.reduce_scatter) and an all-gather of values each
rank owns (hvd_aps._owned.BlockCodes: every block at its own power of two). Every rank gets the same
bits. Each sum or reduce-scatter is one step of the compressor's state, under a name that stays the
same from call to call (a layer's and direction's: its stochastic seeds and schedule).
"""
import torch
import torch.distributed as dist

from . import _arrays, _device, exchange
from ._owned import BlockCodes
from ._stages import Bucket
from .compressor import APSCompressor
from .ddp import TorchDistributedCollectives

_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13 deprecates the second


class _Counted(TorchDistributedCollectives):
    """torch.distributed's collectives, counting the bytes this rank hands them for the others:
    the metadata's, the alltoall's parts for other ranks, the allgather's message once a rank."""

    def __init__(self, group, device, counter: "CodesCollectives"):
        super().__init__(group, device)
        self.counter = counter

    def max_allreduce(self, vector, name):
        self.counter.bytes_sent += int(vector.nbytes * 2 * (self.world - 1) / self.world)  # a ring
        return super().max_allreduce(vector, name)

    def alltoall_start(self, send, splits, name):
        splits = [int(s) for s in _arrays.to_numpy(splits)]
        self.counter.bytes_sent += (sum(splits) - splits[self.rank]) * send.dtype.itemsize
        return super().alltoall_start(send, splits, name)

    def allgather_start(self, message, name):
        self.counter.bytes_sent += int(message.nbytes) * (self.world - 1)
        return super().allgather_start(message, name)


class CodesCollectives:
    """Codes collectives of `compressor` (sums) and `gathered` (all-gathers) over `group`.
    `bytes_sent`: what this rank handed them for the other ranks (every collective's, the
    metadata's Max-allreduce too)."""

    def __init__(self, compressor: APSCompressor, group: dist.ProcessGroup, gathered: BlockCodes):
        self.compressor, self.group, self.gathered = compressor, group, gathered
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._collectives = {}  # per device: they keep the receive buffers
        self.bytes_sent = 0

    def _coll(self, device) -> TorchDistributedCollectives:
        key = str(device)
        if key not in self._collectives:
            self._collectives[key] = _Counted(self.group, device, self)
        return self._collectives[key]

    def all_reduce(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The sum of every rank's x (one shape everywhere), in x's dtype."""
        coll, exchanger = self._coll(x.device), self.compressor.exchanger
        flat = x.detach().reshape(-1).to(torch.float32, copy=True)
        bucket = Bucket.whole(name, [name], [name], [flat.numel()])
        with _device.entered(_device.place_of(flat)), exchanger.exchange():
            array = _arrays.as_array(flat)
            exchange.run(exchanger.stages(coll.world, coll.rank), bucket, array, exchange.Levels.flat(coll), out=array)
        exchanger.end_step()
        return flat.view(x.shape).to(x.dtype)

    def reduce_scatter(self, x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """The sum over the ranks of this rank's chunk of x along `dim` (x.shape[dim] divisible by
        the group's size), in x's dtype."""
        coll, exchanger = self._coll(x.device), self.compressor.exchanger
        chunks = x.detach().chunk(self.world, dim=dim)
        rows = torch.stack([c.reshape(-1) for c in chunks]).to(torch.float32)
        out = torch.empty(rows.shape[1], dtype=torch.float32, device=x.device)
        with _device.entered(_device.place_of(rows)), exchanger.exchange():
            exchanger.state.schedule.unchunked(name)
            exchange.reduce_scatter(exchanger.scatter_stages(coll.world, coll.rank), name, _arrays.as_array(rows), coll,
                                    _arrays.as_array(out))
        exchanger.end_step()
        return out.view(chunks[self.rank].shape).to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (one shape everywhere) concatenated along `dim` in rank order, in x's dtype."""
        n = x.numel()
        with _device.entered(_device.place_of(x)):
            mine = torch.empty(self.gathered.message_bytes(n), dtype=torch.uint8, device=x.device)
            self.gathered.encode(_arrays.as_array(x.detach().reshape(-1).to(torch.float32)), _arrays.as_array(mine))
            gathered = torch.empty(mine.numel() * self.world, dtype=torch.uint8, device=x.device)
            _gather_into(gathered, mine, group=self.group)
            values = torch.empty(n * self.world, dtype=torch.float32, device=x.device)
            self.gathered.decode(_arrays.as_array(gathered), n, _arrays.as_array(values))
        self.bytes_sent += mine.numel() * (self.world - 1)
        return torch.cat(list(values.view(self.world, *x.shape).to(x.dtype)), dim=dim)
