"""hvd_aps.tensor_parallel: torch's tensor-parallel styles with their activations' collectives in
APS codes, for the parallelize_plan users already write (torch.distributed.tensor.parallel)::

    parallelize_module(block, tp_mesh, {   # compressor: an hvd_aps.APSCompressor, e.g. of hvd_aps.e4m3
        "attention.q": hvd_aps.tensor_parallel.CodesColwiseParallel(compressor, input_layouts=Shard(1)),
        "attention.out": hvd_aps.tensor_parallel.CodesRowwiseParallel(compressor, output_layouts=Shard(1))})

In place of ColwiseParallel and RowwiseParallel (same arguments, parameters and outputs), DTensor's
float32 collectives run as codes (hvd_aps._codes_collectives): column-parallel, a replicated input's
gradient sum, a sharded input's all-gather (backward: reduce-scatter) and a replicated output's
all-gather; row-parallel, the output's sum (Replicate) or reduce-scatter (Shard; backward: all-gather).
Sums go through the codes exchange (agreed APS shifts, an exact float32 sum); all-gathers carry each
rank's own block exponents (hvd_aps.BlockCodes, `gathered`). One compressor may serve every layer but
no other entry point: collectives are named by the order the styles are applied, alike on every rank.
"""
import copy
import itertools
import weakref
from typing import Union

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ._codes_collectives import CodesCollectives
from ._owned import BlockCodes
from .compressor import APSCompressor
from .config import Wire
from .formats import FloatFormat

_NAMES = weakref.WeakKeyDictionary()  # compressor -> a counter of the layers styles were applied to with it
_USER = "hvd_aps.tensor_parallel's styles"  # the compressor's one owner (APSCompressor.claim)


class _SumInForward(torch.autograd.Function):
    """Partial -> Replicate: the sum forward; the gradient, already every rank's, passes back."""

    @staticmethod
    def forward(ctx, x, codes, name):
        return codes.all_reduce(x, f"{name}.forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SumInBackward(torch.autograd.Function):
    """A replicated input of a column-parallel layer: forward as it is; its gradient, one partial
    sum a rank, summed backward."""

    @staticmethod
    def forward(ctx, x, codes, name):
        ctx.codes, ctx.name = codes, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.codes.all_reduce(grad, f"{ctx.name}.backward"), None, None


class _GatherInForward(torch.autograd.Function):
    """Shard(dim) -> Replicate: all-gather forward; the gradient's partial sums reduce-scattered
    back to their shards."""

    @staticmethod
    def forward(ctx, x, dim, codes, name):
        ctx.dim, ctx.codes, ctx.name = dim, codes, name
        return codes.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.codes.reduce_scatter(grad.contiguous(), ctx.dim, f"{ctx.name}.backward"), None, None, None


class _ScatterInForward(torch.autograd.Function):
    """Partial -> Shard(dim): reduce-scatter forward; the shards' gradients all-gathered back."""

    @staticmethod
    def forward(ctx, x, dim, codes, name):
        ctx.dim, ctx.codes = dim, codes
        return codes.reduce_scatter(x.contiguous(), dim, f"{name}.forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.codes.all_gather(grad.contiguous(), ctx.dim), None, None, None


class _GatherSliceBackward(torch.autograd.Function):
    """Shard(dim) -> Replicate of a replicated gradient: all-gather forward, each rank's own
    slice of the gradient backward (nothing to send)."""

    @staticmethod
    def forward(ctx, x, dim, codes):
        ctx.dim, ctx.size, ctx.rank = dim, x.shape[dim], codes.rank
        return codes.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size).contiguous(), None, None


class _CodesStyle:
    """What both styles hold: the compressor, the gathers' codes, and per layer applied to, a
    copy of the style bound to that layer's codes collectives and name (_apply)."""

    def _setup(self, compressor: APSCompressor, gathered):
        if not isinstance(compressor, APSCompressor) or compressor.config.wire is not Wire.CODES:
            raise TypeError(f"a codes style needs an hvd_aps.APSCompressor sending codes, got {compressor!r}")
        if compressor.config.error_feedback:
            raise ValueError("activations differ from one micro-batch to the next: error feedback has nothing to "
                             "feed back into; give the style an APSCompressor without it")
        compressor.claim(_USER, shared=True)
        self.compressor = compressor
        self.gathered = BlockCodes.parse(gathered if gathered is not None else compressor.fmt)
        self._codes = self._name = None
        self._applied = []  # the bound copies, one a layer

    def _bound_to(self, device_mesh) -> "_CodesStyle":
        """A copy of this style with a layer's codes collectives over the mesh and its name."""
        if device_mesh.ndim != 1:
            raise ValueError(f"a codes style runs on a 1-D tensor-parallel mesh, got {device_mesh.ndim} dimensions")
        bound = copy.copy(self)
        bound._codes = CodesCollectives(self.compressor, device_mesh.get_group(), self.gathered)
        bound._name = f"tp{next(_NAMES.setdefault(self.compressor, itertools.count()))}"
        self._applied.append(bound)
        return bound

    @property
    def bytes_sent(self) -> int:
        """What this rank sent in the collectives of the layers this style was applied to."""
        return sum(b._codes.bytes_sent for b in self._applied)


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


class CodesColwiseParallel(_CodesStyle, ColwiseParallel):
    """ColwiseParallel whose input's collectives (a replicated input's gradient sum; a sharded
    input's all-gather and its gradient's reduce-scatter) and a replicated output's all-gather are
    codes (the module docstring). compressor: an hvd_aps.APSCompressor (no error feedback);
    gathered: the all-gathers' BlockCodes or format (default: the compressor's format)."""

    def __init__(self, compressor: APSCompressor, *, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True, gathered: Union[BlockCodes, FloatFormat, str, None] = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._setup(compressor, gathered)

    def _apply(self, module, device_mesh):
        return ColwiseParallel._apply(self._bound_to(device_mesh), module, device_mesh)

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        layout = inputs[0].placements[0] if isinstance(inputs[0], DTensor) else input_layouts[0]
        x = _local(inputs[0])
        if layout.is_replicate():
            x = _SumInBackward.apply(x, self._codes, self._name)
        elif layout.is_shard():
            x = _GatherInForward.apply(x, layout.dim % x.ndim, self._codes, self._name)
        else:
            raise ValueError(f"CodesColwiseParallel takes a Replicate or Shard input, got {layout}")
        # grad_placements: the local gradient comes back to the Function above as it is, no DTensor collective
        return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False, grad_placements=(Partial(),))

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        layout, local = output_layouts[0], outputs.to_local()
        if layout.is_replicate():
            out = _GatherSliceBackward.apply(local, local.ndim - 1, self._codes)
        elif layout.is_shard() and layout.dim % local.ndim == local.ndim - 1:
            out = local
        else:
            raise ValueError(f"CodesColwiseParallel gives a Shard(-1) or Replicate output, got {layout}")
        return out if use_local_output else DTensor.from_local(out, device_mesh, output_layouts, run_check=False)


class CodesRowwiseParallel(_CodesStyle, RowwiseParallel):
    """RowwiseParallel whose output's partial sums are summed (Replicate) or reduce-scattered
    (Shard) as codes, and a sharded output's gradient all-gathered as codes (the module
    docstring). Arguments as CodesColwiseParallel's."""

    def __init__(self, compressor: APSCompressor, *, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True, gathered: Union[BlockCodes, FloatFormat, str, None] = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._setup(compressor, gathered)

    def _apply(self, module, device_mesh):
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"CodesRowwiseParallel shards nn.Linear layers, got {type(module).__name__}")
        return RowwiseParallel._apply(self._bound_to(device_mesh), module, device_mesh)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        layout, local = output_layouts[0], outputs.to_local()  # Partial: one partial sum a rank
        if layout.is_replicate():
            out = _SumInForward.apply(local, self._codes, self._name)
        elif layout.is_shard():
            out = _ScatterInForward.apply(local, layout.dim % local.ndim, self._codes, self._name)
        else:
            raise ValueError(f"CodesRowwiseParallel gives a Replicate or Shard output, got {layout}")
        return out if use_local_output else DTensor.from_local(out, device_mesh, output_layouts, run_check=False)


def bytes_sent(styles) -> int:
    """What this rank sent through the codes styles of a plan (its values)."""
    return sum(s.bytes_sent for s in styles if isinstance(s, _CodesStyle))
