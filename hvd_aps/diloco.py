"""hvd_aps.diloco: DiLoCo (Douillard et al., arXiv 2311.08105) around the user's optimizer, its
outer exchange in APS codes; Streaming DiLoCo's fragments and overlap (arXiv 2501.18512)::

    diloco = hvd_aps.diloco.DiLoCo(model, inner, sync_every=500,
                                   compression=hvd_aps.APSCompressor("e3m0", error_feedback=True))
    diloco.zero_grad(); loss.backward(); diloco.step()   # the inner step; every H, the outer one

Every H (`sync_every`) steps the pseudo-gradient (synced - now) is averaged across the workers, as
codes with an APSCompressor (hvd_aps.exchange; error feedback sends what the codes lost with the
next sync), by another implementation's OuterAverage (hvd_aps.diloco_peers: INTELLECT-1's int8
ring), else by the framework's float32 allreduce, and an outer SGD with Nesterov momentum
steps the synced parameters by it: the same bits on every worker. Streaming (`fragments` F,
`delay` tau): fragment f syncs at the steps t = (f + 1) H / F (mod H), its exchange runs beside the
next tau inner steps and is applied after them, their progress weighted by `mix`. Ranks:
torch.distributed's (or `process_group`) or Horovod's; all start from the first rank's parameters.
"""
import abc
import dataclasses
import enum
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _arrays, _device, _metadata, exchange
from ._diloco_schedule import Schedule
from ._stages import Bucket
from .compressor import APSCompressor
from .config import Wire

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's and OpenDiLoCo's outer SGD (Nesterov)


class Backend(enum.Enum):
    """Whose ranks the workers are."""
    TORCH = "torch"      # torch.distributed: Gloo on the CPU, NCCL with CUDA tensors
    HOROVOD = "horovod"  # horovod.torch

    @classmethod
    def parse(cls, backend: Optional[str]) -> "Backend":
        """None: torch.distributed where it is initialised, else Horovod."""
        if backend is None:
            return cls.TORCH if dist.is_available() and dist.is_initialized() else cls.HOROVOD
        try:
            return cls(backend)
        except ValueError:
            raise ValueError(f"backend must be one of {[b.value for b in cls]} or None, got {backend!r}") from None


class OuterAverage(abc.ABC):
    """The outer average of a fragment's flat pseudo-gradient across the workers: start() hands
    it over, wait() gives the average (in the same tensor). DiLoCo(compression=...) takes one
    in place of a compressor (backend="torch"): another implementation's exchange, stateless,
    alike on every rank."""

    @abc.abstractmethod
    def start(self, flat: torch.Tensor, bucket: Bucket) -> tuple:
        """-> a handle for wait()."""

    @abc.abstractmethod
    def wait(self, handle: tuple) -> torch.Tensor:
        """The average of every worker's flat."""


class _CodesAverage(OuterAverage):
    """Through the compressor's codes exchange, each sync one step of its state."""

    def __init__(self, compressor: APSCompressor, levels_of):
        self.compressor, self.levels_of = compressor, levels_of

    def start(self, flat, bucket):
        exchanger, array = self.compressor.exchanger, _arrays.as_array(flat)
        future = exchanger.bucket(self.levels_of(flat.device), bucket, array, place=_device.place_of(flat), out=array,
                                  average=True)
        exchanger.end_step()
        return future, flat

    def wait(self, handle):
        future, flat = handle
        self.compressor.exchanger.result(future)
        return flat


class _TorchFloat32(OuterAverage):
    """torch.distributed's float32 allreduce, divided by the group's size."""

    def __init__(self, group):
        self.group = group

    def start(self, flat, bucket):
        return dist.all_reduce(flat, group=self.group, async_op=True), flat

    def wait(self, handle):
        work, flat = handle
        work.wait()
        return flat.div_(dist.get_world_size(self.group))


class _HorovodFloat32(OuterAverage):
    """Horovod's float32 allreduce, averaged."""

    def start(self, flat, bucket):
        import horovod.torch as hvd
        return hvd.allreduce_async_(flat, op=hvd.Average, name=f"hvd_aps.diloco.{bucket.name}"), flat

    def wait(self, handle):
        import horovod.torch as hvd
        work, flat = handle
        hvd.synchronize(work)
        return flat


@dataclasses.dataclass
class _Fragment:
    """A fragment's parameters (their local tensors are what a worker syncs: _local), the synced
    values and their outer optimizer, and its exchange under way."""
    index: int
    bucket: Bucket
    params: List[torch.nn.Parameter]
    synced: List[torch.Tensor]
    outer: torch.optim.Optimizer
    flat: torch.Tensor
    handle: object = None
    started: Optional[int] = None  # the inner step its exchange started after
    averaged: Optional[torch.Tensor] = None  # a resumed checkpoint's average, not yet applied


class DiLoCo:
    """DiLoCo around `inner` (the model's optimizer, stepped every step), averaging the
    pseudo-gradients every `sync_every` steps (module docstring).

    Arguments:
        model: the torch module `inner` trains (its parameters in their order: the fragments').
        inner: its optimizer; its state (Adam's moments) stays each worker's own.
        sync_every: H, inner steps between a fragment's syncs.
        compression: an hvd_aps.APSCompressor sending codes (e.g. "e3m0" with error_feedback=True),
            an OuterAverage (another implementation's exchange), or None: the framework's
            float32 allreduce.
        outer_lr, outer_momentum: the outer SGD's (Nesterov), DiLoCo's 0.7 and 0.9 by default.
        fragments, delay, mix: Streaming DiLoCo's fragments, the inner steps an exchange runs
            beside before it is applied, and the weight of those steps' progress kept.
        process_group: torch.distributed's ranks to average over (default: every rank).
        backend: "torch", "horovod" or None (torch.distributed where initialised, else Horovod).

    Every worker must pass the same settings and model: the first call checks them and raises on
    every rank, naming what differs. state_dict()/load_state_dict() resume bit for bit.
    """

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, sync_every: int,
                 compression: "APSCompressor | OuterAverage | None" = None, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, fragments: int = 1, delay: int = 0, mix: float = 0.0,
                 process_group: Optional[dist.ProcessGroup] = None, backend: Optional[str] = None):
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"mix must lie in [0, 1) (1: the workers would never take the outer step), got {mix!r}")
        codes = isinstance(compression, APSCompressor) and compression.config.wire is Wire.CODES
        if not (codes or compression is None or isinstance(compression, OuterAverage)):
            raise TypeError(f"compression must be an hvd_aps.APSCompressor sending codes, an OuterAverage or None, "
                            f"got {compression!r}")
        self.model, self.inner = model, inner
        self.compression = compression if codes else None  # the compressor, whose state is DiLoCo's to keep
        self.schedule, self.mix = Schedule(sync_every, fragments, delay), float(mix)
        self.backend, self.process_group = Backend.parse(backend), process_group
        if self.backend is Backend.HOROVOD and process_group is not None:
            raise ValueError("process_group is torch.distributed's: Horovod's workers are every rank")
        if self.backend is Backend.HOROVOD and isinstance(compression, OuterAverage):
            raise TypeError("an OuterAverage exchanges over torch.distributed: use backend='torch'")
        self._outer = _outer_name(compression)  # what a checkpoint must be resumed with
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        parts = _cut(named, fragments)  # refused before anything is claimed or made
        self._check_alike(named, outer_lr, outer_momentum)
        self._broadcast([p for _, p in named])
        self._exchange = compression if isinstance(compression, OuterAverage) else self._exchange_for(compression)
        self._fragments = [self._fragment(f, part, outer_lr, outer_momentum) for f, part in enumerate(parts)]
        self.inner_steps = 0

    # the lifecycle users know -------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """The inner step; then a fragment's sync whose `delay` steps have passed is applied, and
        one that is due starts (with delay 0: applied at once)."""
        self.inner.step()
        self.inner_steps += 1
        for fragment in self._fragments:
            if fragment.started is not None and self.inner_steps - fragment.started == self.schedule.delay:
                self._apply(fragment)
        due = self.schedule.starting(self.inner_steps)
        if due is not None:
            self._start(self._fragments[due])
            if self.schedule.delay == 0:
                self._apply(self._fragments[due])

    def state_dict(self) -> dict:
        """What resuming bit for bit needs: the inner step, every fragment's synced values and outer
        momentum, an exchange under way's average (waited for) and when it started, and the
        compressor's state after it. The inner optimizer's is the user's to save, as always."""
        for fragment in self._fragments:
            if fragment.handle is not None:
                fragment.averaged, fragment.handle = self._exchange.wait(fragment.handle).clone(), None
        return {"inner_steps": self.inner_steps, "schedule": dataclasses.asdict(self.schedule), "mix": self.mix,
                "fragments": [{"synced": [s.clone() for s in f.synced], "outer": f.outer.state_dict(),
                               "started": f.started, "averaged": f.averaged} for f in self._fragments],
                "compressor": None if self.compression is None else self.compression.state_dict(),
                "outer": self._outer}

    def load_state_dict(self, state: dict) -> None:
        """Resume from this worker's state_dict(), on every worker, before the same step."""
        saved = Schedule(**state["schedule"])
        if saved != self.schedule or state["mix"] != self.mix or len(state["fragments"]) != len(self._fragments):
            raise ValueError(f"this state_dict was saved under {saved}, mix {state['mix']} and is loaded under "
                             f"{self.schedule}, mix {self.mix}: resume with the settings it was saved with")
        outer = state.get("outer")  # an earlier release's state names none
        if (outer is not None and outer != self._outer) or (state["compressor"] is None) != (self.compression is None):
            outer = outer or ("float32" if state["compressor"] is None else "codes")
            raise ValueError(f"this state_dict was saved with the outer exchange {outer} and is "
                             f"loaded with {self._outer}: resume with the compression it was saved with")
        for fragment, kept in zip(self._fragments, state["fragments"]):
            if [s.shape for s in kept["synced"]] != [s.shape for s in fragment.synced]:
                raise ValueError(f"fragment {fragment.index} was saved for other parameters")
        for fragment, kept in zip(self._fragments, state["fragments"]):
            with torch.no_grad():
                for synced, value in zip(fragment.synced, kept["synced"]):
                    synced.copy_(value)
            fragment.outer.load_state_dict(kept["outer"])
            fragment.started, fragment.averaged, fragment.handle = kept["started"], kept["averaged"], None
        self.inner_steps = int(state["inner_steps"])
        if self.compression is not None:
            self.compression.load_state_dict(state["compressor"])

    # the outer step ----------------------------------------------------------------------------
    def _start(self, fragment: _Fragment) -> None:
        """The fragment's pseudo-gradient (synced - now) handed to the exchange."""
        with torch.no_grad():
            torch.cat([(s - _local(p)).reshape(-1) for s, p in zip(fragment.synced, fragment.params)],
                      out=fragment.flat)
        fragment.handle, fragment.started = self._exchange.start(fragment.flat, fragment.bucket), self.inner_steps

    def _apply(self, fragment: _Fragment) -> None:
        """The outer SGD step on the synced values by the averaged pseudo-gradient; the parameters
        become the new synced values, with `mix` of what the worker moved meanwhile."""
        averaged = fragment.averaged if fragment.handle is None else self._exchange.wait(fragment.handle)
        fragment.handle = fragment.averaged = fragment.started = None
        offset = 0
        for synced in fragment.synced:
            synced.grad = averaged[offset:offset + synced.numel()].view_as(synced).clone()
            offset += synced.numel()
        fragment.outer.step()
        with torch.no_grad():
            for synced, p in zip(fragment.synced, fragment.params):
                local = _local(p)
                local.copy_(synced if self.mix == 0 else torch.lerp(synced, local.to(torch.float32), self.mix))

    # set-up -------------------------------------------------------------------------------------
    def _fragment(self, index: int, named: list, outer_lr: float, outer_momentum: float) -> _Fragment:
        params = [p for _, p in named]
        synced = [_local(p).detach().clone().to(torch.float32) for p in params]
        outer = torch.optim.SGD(synced, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        keys = [f"diloco.{name}" for name, _ in named]
        bucket = Bucket.whole(f"diloco.fragment{index}", keys, keys, [s.numel() for s in synced])
        flat = torch.empty(sum(bucket.sizes), dtype=torch.float32, device=synced[0].device)
        return _Fragment(index, bucket, params, synced, outer, flat)

    def _exchange_for(self, compression) -> OuterAverage:
        if compression is None:
            return _TorchFloat32(self.process_group) if self.backend is Backend.TORCH else _HorovodFloat32()
        compression.claim("an hvd_aps.diloco.DiLoCo")
        cfg = compression.config
        if self.backend is Backend.HOROVOD:
            from .torch import adapter
            levels = adapter.levels(cfg.hierarchical, timeout=cfg.timeout)
            return _CodesAverage(compression, lambda device: levels)
        from .ddp import TorchDistributedCollectives, group_levels, levels_on
        # every rank: a private copy of the world, two levels where hosts hold several ranks; a
        # process group (one of several, each rank in one: sites' replicas) flat, over itself
        # (new_group would need every rank of the world in every group's making)
        groups, made = group_levels(None, cfg.hierarchical, cfg.timeout) if self.process_group is None else None, {}

        def levels_of(device):
            if str(device) not in made:
                made[str(device)] = (levels_on(groups, device) if groups is not None else
                                     exchange.Levels.flat(TorchDistributedCollectives(self.process_group, device)))
            return made[str(device)]
        return _CodesAverage(compression, levels_of)

    def _check_alike(self, named: list, outer_lr: float, outer_momentum: float) -> None:
        """Every worker's settings and parameter shapes, gathered: the same everywhere, or every
        worker raises naming what differs."""
        mine = {"sync_every": self.schedule.sync_every, "fragments": self.schedule.fragments,
                "delay": self.schedule.delay, "mix": self.mix, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                # the rest of a compressor's settings: checked by its first exchange
                "compression": self._outer,
                "parameters": tuple(tuple(_local(p).shape) for _, p in named)}
        _metadata.check_same_settings(self._gathered(mine))

    def _broadcast(self, params: list) -> None:
        """Every worker's parameters the first rank's (of the process group)."""
        if self.backend is Backend.HOROVOD:
            import horovod.torch as hvd
            for k, p in enumerate(params):
                hvd.broadcast_(_local(p).data, root_rank=0, name=f"hvd_aps.diloco.start{k}")
            return
        first = dist.get_global_rank(self.process_group or dist.group.WORLD, 0)
        for p in params:
            dist.broadcast(_local(p).data, first, group=self.process_group)

    def _gathered(self, obj) -> list:
        if self.backend is Backend.HOROVOD:
            import horovod.torch as hvd
            return hvd.allgather_object(obj, name="hvd_aps.diloco.settings")
        gathered = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(gathered, obj, group=self.process_group)
        return gathered


def _outer_name(compression) -> str:
    """What the workers compare of the outer exchange (a compressor's other settings: its first exchange)."""
    if compression is None:
        return "float32"
    return str(compression.config.fmt) if isinstance(compression, APSCompressor) else type(compression).__name__


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor a worker steps: an FSDP2 parameter's (a DTensor's) local shard, else itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def _cut(named: Sequence, fragments: int) -> list:
    """`fragments` runs of consecutive parameters of about equal elements, at least one each: a
    run ends at the parameter boundary nearest its share of the elements."""
    if fragments > len(named):
        raise ValueError(f"fragments ({fragments}) must not exceed the model's {len(named)} parameters")
    sizes = [p.numel() for _, p in named]  # global: every shard of a parameter in the same fragment
    total, parts, start, seen = sum(sizes), [], 0, 0
    for f in range(1, fragments):
        end, seen = start + 1, seen + sizes[start]
        while end < len(named) - (fragments - f) and seen + sizes[end] / 2 <= total * f / fragments:
            seen += sizes[end]
            end += 1
        parts.append(named[start:end])
        start = end
    return parts + [named[start:]]
