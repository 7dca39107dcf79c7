"""horovod.torch adapter for APSCompressor (hvd_aps._tokens.Adapter): Horovod's collectives for
the exchange driver (one object per process set), the groups of a two-level exchange,
conversions between tensors and the codec's arrays, and the values path. Tensors reach the codec
through DLPack: zero-copy on the CPU, and on a GPU through the CuPy engine. No APS math here."""
import functools
import pickle
import time

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError
import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from .. import _arrays, _device, _horovod, _metadata, _tokens, _values, codec, exchange
from .._horovod import HorovodLevels, is_global
from ..config import DEFAULT_TIMEOUT

# hvd.synchronize() spins (std::this_thread::yield, taking the GIL back on every turn): two
# exchange threads waiting in it took a core from backward and the GIL from its hooks. Waiting
# is instead a poll with sleeps growing from POLL_FIRST to POLL_MAX seconds (the GIL free meanwhile),
# for `timeout` seconds at most (hvd_aps._horovod.no_answer).
POLL_FIRST, POLL_MAX = 20e-6, 250e-6
# One name for every values-path metadata allreduce: the calls are blocking and sequential
# (backward hooks run one at a time), and a reused name hits Horovod's response cache.
_METADATA = "hvd_aps.metadata"
_TOKENS = {}  # (rank, device) -> the token token() copies


class NoAnswer(TimeoutError, HorovodInternalError):
    """An exchange of the codes path got no answer within APSConfig.timeout: a TimeoutError, and
    Horovod's HorovodInternalError, so that Horovod elastic resets the job (shutdown and init, the
    remedy the message names) instead of the worker dying with the request still held. The ranks'
    agreement on settings and buckets raises a plain TimeoutError: ranks that disagree would
    disagree again after a reset."""


class HorovodCollectives(exchange.AsyncEager):
    """horovod.torch collectives on NumPy/CuPy arrays, within one process set, each waited for
    `timeout` seconds at most. A handle is (Horovod's handle, what the wait names). `reset`: a
    wait that runs out raises NoAnswer, which Horovod elastic resets on, else a TimeoutError."""

    equal_allgather = False  # Horovod gathers messages of any sizes

    def __init__(self, process_set=hvd.global_process_set, timeout: float = DEFAULT_TIMEOUT, reset: bool = True):
        self.process_set, self.timeout, self.reset = process_set, timeout, reset
        self.world, self.rank = process_set.size(), process_set.rank()

    def max_allreduce(self, vector, name):
        return self.wait((hvd.allreduce_async(torch.from_dlpack(vector), op=hvd.Max, name=name,
                                              process_set=self.process_set), f"the Max-allreduce {name}"))

    def allreduce(self, values, name):
        return self.wait((hvd.allreduce_async(torch.from_dlpack(values), op=hvd.Sum, name=name,
                                              process_set=self.process_set), f"the allreduce {name}"))

    def alltoall_start(self, send, splits, name):
        return hvd.alltoall_async(torch.from_dlpack(send), splits=torch.from_numpy(_arrays.to_numpy(splits)),
                                  name=name, process_set=self.process_set), f"the alltoall {name}"

    def allgather_start(self, message, name):
        return hvd.allgather_async(torch.from_dlpack(message), name=name,
                                   process_set=self.process_set), f"the allgather {name}"

    def wait(self, handle):
        out = wait(*handle, self.process_set, self.timeout, self.reset)  # alltoall: (received, received splits)
        return _arrays.as_array(out[0] if isinstance(out, tuple) else out)


def wait(handle, what, process_set, timeout, reset: bool = True):
    """hvd.synchronize(handle) without its spinning (POLL_FIRST), and not for ever: `what` (the
    collective) waited for `timeout` seconds at most (`reset`: NoAnswer past it, else TimeoutError)."""
    delay, deadline = POLL_FIRST, time.monotonic() + timeout
    while not hvd.poll(handle):
        if time.monotonic() >= deadline:
            raise _horovod.no_answer(timeout, what, process_set, hvd.rank(), NoAnswer if reset else TimeoutError)
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX)
    return hvd.synchronize(handle)


def gather(obj, process_set, name, timeout=DEFAULT_TIMEOUT):
    """Every rank's `obj` (picklable), in rank order of the process set: Horovod's own
    allgather_object spans every rank (a process set's ranks cannot ask the others) and waits
    without a bound."""
    coll = HorovodCollectives(process_set or hvd.global_process_set, timeout, reset=False)
    data = np.frombuffer(bytearray(pickle.dumps(obj)), np.uint8)
    sizes = coll.allgather(np.array([data.size]), f"{name}.sizes")
    blob = coll.allgather(data, name)
    return [pickle.loads(part.tobytes()) for part in np.split(blob, np.cumsum(sizes)[:-1])]


_LEVELS = HorovodLevels(hvd, HorovodCollectives, host_memory=True,
                        gather=lambda obj, name, timeout: gather(obj, None, name, timeout))


def levels(hierarchical, process_set=None, timeout=DEFAULT_TIMEOUT) -> exchange.Levels:
    """The exchange's groups for this Horovod job or process set (hvd_aps._horovod), their waits
    bounded by `timeout` seconds: collective on first use."""
    return _LEVELS.get(hierarchical, process_set, timeout)


def forget_groups() -> None:
    _LEVELS.forget()


# The codes path through Horovod's own optimizer and allreduce ----------------------------------------
threaded = True  # exchanges run on the exchanger's threads, so backward goes on


def is_dense_float(tensor):
    return tensor.is_floating_point() and tensor.layout == torch.strided


def is_empty(tensor):
    return tensor.numel() == 0


def world(process_set=None):
    """The ranks Horovod's allreduce spans (on `process_set`; None: every rank)."""
    return hvd.size() if is_global(process_set) else process_set.size()


call_site = _horovod.call_site  # a gradient's name and process set, from Horovod's calling frame


def zeros(like, count):
    """A gradient no hook handed over this step, as zeros of `count` elements (as Horovod's
    optimizer sends a parameter its rank did not use)."""
    return torch.zeros(count, dtype=torch.float32, device=like.device)


def numel(tensor):
    return tensor.numel()


def reducible(tensor):
    """Whether Horovod's own allreduce takes this dtype: a small bfloat16 gradient it does not
    carry goes in float32."""
    return tensor.dtype != torch.bfloat16 or carries_bfloat16(tensor)


def carries_bfloat16(tensor):
    """Whether Horovod's own allreduce takes this tensor in bfloat16: only on the GPU, with NCCL
    (its CPU ops refuse the type: Horovod #4047)."""
    return tensor.is_cuda


def label(tensor):
    return _label(tensor.dtype, tensor.shape)


@functools.lru_cache(maxsize=None)
def _label(dtype, shape) -> str:
    """Formatted once per dtype and shape: every gradient of every step asks."""
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def flatten(tensor):
    """The gradient as join() takes it: the tensor itself (join flattens the batch in one call),
    detached where autograd tracks it (a gradient rarely is: no new tensor for every gradient)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _flat_array(tensor):
    """float32 NumPy/CuPy view of the gradient (a copy only where it is not float32 contiguous);
    a CPU tensor's straight from torch, without as_array's probe for a CUDA device."""
    flat = _as_dtype(tensor.detach(), torch.float32).reshape(-1)
    return flat.numpy() if flat.device.type == "cpu" else _arrays.as_array(flat)


def join(flats):
    """One float32 copy of the batch's gradients end to end (Horovod's gradients lie apart), in
    one call, as the codec's array."""
    return _arrays.as_array(_flatten_dense_tensors([_as_dtype(t, torch.float32) for t in flats]))


def place(tensor):
    """A CUDA gradient's exchange runs on its device, on the stream current where it was handed over."""
    return _device.place_of(tensor)


def token(tensor, process_set=None):
    """A copy of this rank's token on the gradient's device (Horovod reduces it in place)."""
    return _token(process_set, tensor.device).clone()


def tokens(like, process_set, count):
    """`count` tokens as rows of one tensor (Horovod reduces each in place), in one copy."""
    return list(_token(process_set, like.device).expand(count, -1).contiguous().unbind(0))


def _token(process_set, device):
    """This rank's token (its rank in the process set) on `device`, made once per rank and
    device: every gradient of every step asks."""
    key = (hvd.rank() if is_global(process_set) else process_set.rank(), device)
    made = _TOKENS.get(key)
    if made is None:
        made = _TOKENS[key] = torch.tensor(_tokens.token_values(key[0]), device=device)
    return made


def finish(total, token_out, like, reduction, ranks):
    if reduction.averaged:  # the results need no token: it is checked with the step's others, in one read
        reduction.unread.append((token_out, ranks))
        reduced = total
    else:
        reduced = _tokens.apply_op(total, token_out.tolist(), ranks, reduction)
    # shaped before it becomes a tensor: NumPy's reshape costs a fraction of torch's view, per gradient
    out = torch.from_numpy(reduced.reshape(like.shape)) if isinstance(reduced, np.ndarray) else \
        torch.from_dlpack(reduced).view(like.shape)
    return _as_dtype(out, like.dtype)


def read_tokens(tokens):
    """The step's reduced tokens (each the two elements token() and tokens() make) as rows, in
    one stack and one read."""
    return torch.stack(tokens).tolist()


def at_step_end(out, end_step, results):
    """The step's last result: every exchange of it has finished, so it ends now."""
    end_step()
    return out


def native_wire(tensor, fallback):
    return _as_dtype(tensor, getattr(torch, fallback.value))


def native_result(reduced, like):
    return _as_dtype(reduced, like.dtype)


def _as_dtype(tensor, dtype):
    """tensor.to(dtype) without its call where the dtype is already that (the float32 gradients
    of a policy that settled on float32)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


# wire="values" ------------------------------------------------------------------------------------
def compress_values(tensor, exchanger, process_set=None):
    config, x = exchanger.config, _flat_array(tensor)
    process_set = process_set or hvd.global_process_set
    vector = _metadata.vector(config, [codec.amax(x)], [x.size])
    agreed = HorovodCollectives(process_set, config.timeout).max_allreduce(vector, _METADATA)
    amax = float(_metadata.read(config, agreed, [x.size], [label(tensor)])[0][0])
    seed = exchanger.state.values_seed(process_set.rank(), label(tensor))
    wire, shift = _values.to_wire(config, exchanger.recorder, x, amax, process_set.size(), seed, label(tensor))
    return torch.from_dlpack(wire).reshape(tensor.shape), (shift, tensor.dtype, label(tensor))


def decompress_values(tensor, ctx, exchanger):
    shift, dtype, name = ctx
    exchanger.state.values_done(name)
    return torch.from_dlpack(_values.from_wire(_flat_array(tensor), shift)).reshape(tensor.shape).to(dtype)
