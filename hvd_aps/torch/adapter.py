"""horovod.torch adapter for APSCompressor: the Max-allreduce of the metadata, and handing tensors
to the codec and back through DLPack (zero-copy on the CPU, and on a GPU through the CuPy engine).
No APS math here; hvd_aps.compressor holds it."""
import horovod.torch as hvd
import torch

from .. import codec

# One name for every metadata allreduce: the calls are blocking and sequential (backward hooks
# run one at a time), and a reused name hits Horovod's response cache (~1.3 ms instead of 2.4).
_METADATA = "hvd_aps.metadata"


def is_dense_float(tensor):
    return tensor.is_floating_point() and tensor.layout == torch.strided and tensor.numel() > 0


def _as_array(tensor):
    """float32 NumPy array (CPU) or CuPy array (CUDA) sharing the tensor's memory where it can."""
    return codec.as_array(tensor.detach().to(torch.float32).contiguous())


def compress(tensor, comp):
    x = _as_array(tensor)
    agreed = hvd.allreduce(torch.from_numpy(comp.metadata(codec.amax(x))), op=hvd.Max, name=_METADATA)
    amax = comp.check_agreed(agreed.numpy())
    label = f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
    wire, shift = comp.to_wire(x, amax, hvd.size(), hvd.rank(), label)
    return torch.from_dlpack(wire).reshape(tensor.shape), (shift, tensor.dtype)


def decompress(tensor, ctx, comp):
    shift, dtype = ctx
    return torch.from_dlpack(comp.from_wire(_as_array(tensor), shift)).to(dtype)
