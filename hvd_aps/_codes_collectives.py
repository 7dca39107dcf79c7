"""Collectives on torch tensors of one process group, in codes: an all-gather of values each rank
owns (hvd_aps._owned.BlockCodes: every block at its own power of two; FSDP2's parameters and the
tensor-parallel styles), and the three model parallelism runs: a sum (hvd_aps.exchange.run: agreed
APS shifts, an exact float32 sum at each shard's owner, one rounding), a reduce-scatter
(hvd_aps.exchange.reduce_scatter) and that all-gather. Every rank gets the same bits. Each sum or
reduce-scatter is one step of the compressor's state, under a name that stays the same from call
to call (a layer's and direction's: its stochastic seeds and schedule).
"""
import enum

import torch
import torch.distributed as dist

from . import _arrays, _device, exchange
from ._owned import BlockCodes
from ._stages import Bucket
from .compressor import APSCompressor
from .ddp import TorchDistributedCollectives

gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13 deprecates the second
CODED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what codes carry: any other dtype goes as it is


class _Buffer(enum.Enum):
    """What a kept buffer of a gather holds."""
    MESSAGE = "this rank's message"
    GATHERED = "every rank's messages"
    VALUES = "the decoded values"


class BlockGather:
    """An all-gather of values each rank owns as `codes` (a BlockCodes): this rank's encoded,
    every rank's messages gathered, all decoded into the output. `bytes_sent`: what this rank sent."""

    def __init__(self, codes: BlockCodes):
        self.codes, self.bytes_sent = codes, 0
        self._kept = {}  # CPU buffers by use: large fresh pages cost more than the copies into them

    def __call__(self, mine: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `mine` (one size everywhere) into flat `out` (world x its size, rank after
        rank, in out's dtype: one of CODED_DTYPES) -> out. `mine` is read before `out` is written
        (FSDP2's input is this rank's slot of its output)."""
        world, n = dist.get_world_size(group), mine.numel()
        if out.numel() != world * n:
            raise ValueError(f"a gather of {n} values from each of {world} ranks fills {world * n}, not {out.numel()}")
        with _device.entered(_device.place_of(mine)):  # on CUDA: the caller's stream
            message = self._buffer(_Buffer.MESSAGE, self.codes.message_bytes(n), torch.uint8, mine.device)
            self.codes.encode(_arrays.as_array(mine.detach().reshape(-1).to(torch.float32)), _arrays.as_array(message))
            gathered = self._buffer(_Buffer.GATHERED, message.numel() * world, torch.uint8, mine.device)
            gather_into(gathered, message, group=group)
            direct = out.dtype == torch.float32 and out.is_contiguous()
            values = out if direct else self._buffer(_Buffer.VALUES, out.numel(), torch.float32, out.device)
            self.codes.decode(_arrays.as_array(gathered), n, _arrays.as_array(values.reshape(-1)))
            if not direct:
                out.copy_(values.view(out.shape))
        self.bytes_sent += message.numel() * (world - 1)
        return out

    def _buffer(self, use: _Buffer, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer: kept on the CPU; fresh on CUDA, where the caching allocator orders its
        reuse by stream (FSDP gathers on more than one)."""
        if device.type != "cpu":
            return torch.empty(n, dtype=dtype, device=device)
        kept = self._kept.get(use)
        if kept is None or kept.numel() != n:
            kept = self._kept[use] = torch.empty(n, dtype=dtype)
        return kept


class _Counted(TorchDistributedCollectives):
    """torch.distributed's collectives, counting the bytes this rank hands them for the others:
    the metadata's, the alltoall's parts for other ranks, the allgather's message once a rank."""

    def __init__(self, group, device):
        super().__init__(group, device)
        self.sent = 0

    def max_allreduce(self, vector, name):
        self.sent += int(vector.nbytes * 2 * (self.world - 1) / self.world)  # a ring
        return super().max_allreduce(vector, name)

    def alltoall_start(self, send, splits, name):
        splits = [int(s) for s in _arrays.to_numpy(splits)]
        self.sent += (sum(splits) - splits[self.rank]) * send.dtype.itemsize
        return super().alltoall_start(send, splits, name)

    def allgather_start(self, message, name):
        self.sent += int(message.nbytes) * (self.world - 1)
        return super().allgather_start(message, name)


class CodesCollectives:
    """Codes collectives of `compressor` (sums) and `gathered` (all-gathers) over `group`.
    `bytes_sent`: what this rank handed them for the other ranks (every collective's, the
    metadata's Max-allreduce too)."""

    def __init__(self, compressor: APSCompressor, group: dist.ProcessGroup, gathered: BlockCodes):
        self.compressor, self.group, self._gather = compressor, group, BlockGather(gathered)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._collectives = {}  # per device: they keep the receive buffers
        self._sent = 0  # by the sums' and reduce-scatters' collectives

    @property
    def bytes_sent(self) -> int:
        return self._sent + self._gather.bytes_sent

    def _coll(self, device) -> TorchDistributedCollectives:
        key = str(device)
        if key not in self._collectives:
            self._collectives[key] = _Counted(self.group, device)
        return self._collectives[key]

    def all_reduce(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The sum of every rank's x (one shape everywhere), in x's dtype."""
        coll, exchanger = self._coll(x.device), self.compressor.exchanger
        flat = x.detach().reshape(-1).to(torch.float32, copy=True)
        bucket = Bucket.whole(name, [name], [name], [flat.numel()])
        sent = coll.sent
        with _device.entered(_device.place_of(flat)), exchanger.exchange():
            array = _arrays.as_array(flat)
            exchange.run(exchanger.stages(coll.world, coll.rank), bucket, array, exchange.Levels.flat(coll), out=array)
        exchanger.end_step()
        self._sent += coll.sent - sent
        return flat.view(x.shape).to(x.dtype)

    def reduce_scatter(self, x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """The sum over the ranks of this rank's chunk of x along `dim` (x.shape[dim] divisible by
        the group's size), in x's dtype."""
        if x.shape[dim] % self.world:
            raise ValueError(f"a reduce-scatter over {self.world} ranks cuts dimension {dim} of {tuple(x.shape)} into "
                             f"equal chunks: its size must be a multiple of {self.world}")
        coll, exchanger = self._coll(x.device), self.compressor.exchanger
        chunks = x.detach().chunk(self.world, dim=dim)
        rows = torch.stack([c.reshape(-1) for c in chunks]).to(torch.float32)
        out, sent = torch.empty(rows.shape[1], dtype=torch.float32, device=x.device), coll.sent
        with _device.entered(_device.place_of(rows)), exchanger.exchange():
            exchanger.state.schedule.unchunked(name)
            exchange.reduce_scatter(exchanger.scatter_stages(coll.world, coll.rank), name, _arrays.as_array(rows), coll,
                                    _arrays.as_array(out))
        exchanger.end_step()
        self._sent += coll.sent - sent
        return out.view(chunks[self.rank].shape).to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (one shape everywhere) concatenated along `dim` in rank order, in x's dtype."""
        values = self._gather(x, self.group, torch.empty(self.world * x.numel(), dtype=x.dtype, device=x.device))
        return torch.cat(list(values.view(self.world, *x.shape)), dim=dim)
