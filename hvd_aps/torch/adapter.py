"""horovod.torch adapter for APSCompressor: Horovod's collectives for the exchange driver, the
codes path's batch launch (a communication thread, so backward goes on), and the values path.
Tensors reach the codec through DLPack: zero-copy on the CPU, and on a GPU through the CuPy engine.
No APS math here; hvd_aps.compressor holds it."""
import concurrent.futures

import horovod.torch as hvd
import torch

from .. import _arrays, codec, exchange, tokens

# One name for every values-path metadata allreduce: the calls are blocking and sequential
# (backward hooks run one at a time), and a reused name hits Horovod's response cache.
_METADATA = "hvd_aps.metadata"
# The exchanges' threads, for the compressor's batches and hvd_aps.torch.DistributedOptimizer's
# buckets alike. Two: one exchange's encoding and decoding overlap another's transfers; Horovod
# matches collectives by name, so exchanges may run in any order on each rank.
COMM_THREADS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hvd_aps_comm")


class HorovodCollectives(exchange.AsyncEager):
    """horovod.torch collectives on NumPy/CuPy arrays."""

    def __init__(self, process_set=hvd.global_process_set):
        self.process_set = process_set
        self.world, self.rank = process_set.size(), process_set.rank()

    def max_allreduce(self, vector, name):
        return _arrays.as_array(hvd.allreduce(torch.from_dlpack(vector), op=hvd.Max, name=name,
                                              process_set=self.process_set))

    def alltoall_start(self, send, splits, name):
        return hvd.alltoall_async(torch.from_dlpack(send), splits=torch.from_numpy(_arrays.to_numpy(splits)),
                                  name=name, process_set=self.process_set)

    def allgather_start(self, message, name):
        return hvd.allgather_async(torch.from_dlpack(message), name=name, process_set=self.process_set)

    def wait(self, handle):
        out = hvd.synchronize(handle)  # alltoall: (received, received splits)
        return _arrays.as_array(out[0] if isinstance(out, tuple) else out)



def is_dense_float(tensor):
    return tensor.is_floating_point() and tensor.layout == torch.strided and tensor.numel() > 0


def numel(tensor):
    return tensor.numel()


def label(tensor):
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


def flatten(tensor):
    """float32 NumPy/CuPy view of the gradient (a copy only where it is not float32 contiguous)."""
    return _arrays.as_array(tensor.detach().to(torch.float32).reshape(-1))


def world():
    return hvd.size()


def rank():
    return hvd.rank()


def token(tensor):
    return torch.from_numpy(tokens.token_values(hvd.rank())).to(tensor.device)


def launch(stages, flats, name, labels):
    return COMM_THREADS.submit(exchange.run, stages, flats, HorovodCollectives(), name, labels)


def finish(handle, index, token_out, like):
    total = handle.result()[index]
    reduced = tokens.apply_op(total, token_out.cpu().numpy(), hvd.size())
    return torch.from_dlpack(reduced).reshape(like.shape).to(like.dtype)


# wire="values" ------------------------------------------------------------------------------------
def compress_values(tensor, comp):
    x = flatten(tensor)
    agreed = hvd.allreduce(torch.from_numpy(comp.metadata([codec.amax(x)], [x.size])), op=hvd.Max, name=_METADATA)
    amax = float(comp.agreed_amaxes(agreed.numpy(), [x.size], [label(tensor)])[0])
    wire, shift = comp.to_wire(x, amax, hvd.size(), hvd.rank(), label(tensor))
    return torch.from_dlpack(wire).reshape(tensor.shape), (shift, tensor.dtype)


def decompress_values(tensor, ctx, comp):
    shift, dtype = ctx
    return torch.from_dlpack(comp.from_wire(flatten(tensor), shift)).reshape(tensor.shape).to(dtype)
