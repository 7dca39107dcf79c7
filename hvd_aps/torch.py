"""horovod.torch adapter for APSCompressor: max |g|, the Max-allreduce, and tensor <-> NumPy.
No APS math here; hvd_aps.compressor holds it."""
import horovod.torch as hvd
import torch

from . import codec

# One name for every metadata allreduce: the calls are blocking and sequential (backward hooks
# run one at a time), and a reused name hits Horovod's response cache (~1.3 ms instead of 2.4).
_METADATA = "hvd_aps.metadata"


def is_dense_float(tensor):
    return tensor.is_floating_point() and tensor.layout == torch.strided and tensor.numel() > 0


def _host_float32(tensor):
    """float32 NumPy view (a copy only for other dtypes or devices)."""
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def compress(tensor, comp):
    x = _host_float32(tensor)
    agreed = hvd.allreduce(torch.from_numpy(comp.metadata(codec.amax(x))), op=hvd.Max, name=_METADATA)
    amax = comp.check_agreed(agreed.numpy())
    label = f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
    wire, shift = comp.to_wire(x, amax, hvd.size(), hvd.rank(), label)
    return torch.from_numpy(wire.reshape(x.shape)).to(tensor.device), (shift, tensor.dtype)


def decompress(tensor, ctx, comp):
    shift, dtype = ctx
    return torch.from_numpy(comp.from_wire(_host_float32(tensor), shift)).to(tensor.device, dtype)
