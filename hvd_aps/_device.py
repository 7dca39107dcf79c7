"""Where the exchange's device work runs, and what it keeps on the device between steps.

A framework hands the exchange a bucket on a stream of its own (DDP: backward's; FSDP2: those it
made for its hooks). The exchange's CuPy kernels, allocations and DLPack hand-offs run on that
stream and device (`Place`, taken where the framework calls, entered in whichever thread
launches): ordered after the gradients they read and before what the framework queues after the
hook, with no host wait, and never on device 0 from a thread whose device was never set. A thread
that exchanges beside others (a DDP lane, Horovod's exchange threads) takes a stream of its own
(`branch`) that first waits for the framework's: its collectives never queue behind another
lane's on a shared stream (two ranks could queue them in opposite orders).

`on_device`: host arrays the stages index the device with (a table's rows, a message's exponent
bytes) are copied once, on the stream that first needs them (others wait for an event behind the
copy), and kept as long as the host array lives, so a stage uploads nothing in steady state.
"""
import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Hashable, Iterator, List, Optional

import numpy as np

from . import _arrays
from ._arrays import Array


@dataclasses.dataclass(frozen=True)
class Place:
    """A CUDA device and the stream (a cudaStream_t as an int) the framework handed the exchange,
    with the framework's own stream object where it has one (torch: its collectives and copies
    must run on that stream too)."""
    device: int
    stream: int
    torch_stream: object = None
    after: object = None  # a torch.cuda.Event the stream waits for when entered


def place_of(tensor: Any) -> Optional[Place]:
    """Where a torch tensor's exchange runs: its device and the stream current there in the
    calling thread (the framework's); None for a tensor off CUDA."""
    if not getattr(tensor, "is_cuda", False):
        return None
    import torch
    stream = torch.cuda.current_stream(tensor.device)
    return Place(tensor.device.index, stream.cuda_stream, stream)


@contextlib.contextmanager
def entered(place: Optional[Place]) -> Iterator[None]:
    """Inside: CuPy's (and with a torch stream, torch's) current device and stream are the
    place's in this thread, and CuPy allocates from torch's caching allocator, so the two
    pools never compete for the device's memory. No place: nothing changes."""
    if place is None:
        yield
        return
    import cupy
    with contextlib.ExitStack() as stack:
        if place.torch_stream is not None:
            import torch
            stack.enter_context(torch.cuda.device(place.device))
            stack.enter_context(torch.cuda.stream(place.torch_stream))
            stack.enter_context(cupy.cuda.using_allocator(_torch_allocation))
            if place.after is not None:
                place.torch_stream.wait_event(place.after)
        stack.enter_context(cupy.cuda.Device(place.device))
        stack.enter_context(cupy.cuda.ExternalStream(place.stream, place.device))
        yield


_streams = {}  # (device, key) -> the torch stream of a thread that exchanges beside others
_streams_lock = threading.Lock()


def branch(place: Optional[Place], key: Hashable) -> Optional[Place]:
    """A place on a stream of its own for `key` (made once per device), which waits for what
    `place`'s stream has queued until now (an event recorded here, in the framework's thread)."""
    if place is None or place.torch_stream is None:
        return place
    import torch
    with _streams_lock:
        stream = _streams.get((place.device, key))
        if stream is None:
            stream = _streams[place.device, key] = torch.cuda.Stream(place.device)
    ready = torch.cuda.Event()
    ready.record(place.torch_stream)
    return Place(place.device, stream.cuda_stream, stream, ready)


def finished(place: Optional[Place]) -> None:
    """Wait on the host for everything queued on the place's stream: results handed to a reader on
    a stream of its own (Horovod's decompress, the codes optimizer's copy-back) are complete."""
    if place is not None and place.torch_stream is not None:
        place.torch_stream.synchronize()


class _TorchBlock:
    """Memory from torch's caching allocator, given back when CuPy drops its last pointer."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        if self.ptr:
            import torch
            torch.cuda.caching_allocator_delete(self.ptr)


def _torch_allocation(size: int) -> Any:
    """CuPy's allocator inside `entered`: `size` bytes from torch's caching allocator, on the
    current device and stream."""
    import cupy
    import torch
    device = cupy.cuda.Device().id
    ptr = torch.cuda.caching_allocator_alloc(size, device, cupy.cuda.get_current_stream().ptr) if size else 0
    memory = cupy.cuda.UnownedMemory(ptr, size, _TorchBlock(ptr), device)
    return cupy.cuda.MemoryPointer(memory, 0)


@dataclasses.dataclass
class _Copy:
    """A host array's copy on one device: the stream it was made on, an event recorded behind it,
    and the streams known to run after it (that one, and those that waited for the event)."""
    array: object
    event: object
    after: set


_copies = {}  # (id of the host array, device) -> its _Copy, dropped when the host array goes
_copies_lock = threading.Lock()


def on_device(host: np.ndarray, like: Array) -> Array:
    """`host` as an array of `like`'s kind: itself for NumPy, else its copy on the current device,
    made once and kept while `host` lives; the current stream ordered after the copy."""
    xp = _arrays.array_module(like)
    if xp is np:
        return host
    key, stream = (id(host), xp.cuda.Device().id), xp.cuda.get_current_stream()
    with _copies_lock:
        kept = _copies.get(key)
        if kept is not None and stream.ptr in kept.after:
            return kept.array
    if kept is None:
        copy, event = xp.asarray(host), xp.cuda.Event(disable_timing=True)
        event.record(stream)
        with _copies_lock:
            if key not in _copies:  # another thread may have made one meanwhile: keep the first
                _copies[key] = _Copy(copy, event, {stream.ptr})
                weakref.finalize(host, _copies.pop, key, None)
            kept = _copies[key]
    if stream.ptr not in kept.after:
        stream.wait_event(kept.event)
        with _copies_lock:
            kept.after.add(stream.ptr)
    return kept.array


def take(values: Array, index: np.ndarray) -> Array:
    """values[index] where `values` lies, with the host index array copied there once."""
    return values[on_device(index, values)]


def where(array: Array) -> Optional[tuple]:
    """(device, stream handle) current for a device array made here, None for a host array: where
    a later copy of it must run to come after the work that made it."""
    xp = _arrays.array_module(array)
    if xp is np:
        return None
    return xp.cuda.Device().id, xp.cuda.get_current_stream().ptr


def copied_to_host(waiting: list) -> Iterator[List[np.ndarray]]:
    """Each (where, arrays) of `waiting` -> its arrays on the host, in order, as an iterator: the
    device arrays of each (device, stream) in one copy, on that stream after the work that made
    them, whichever thread asks."""
    copies = {}
    for place in {place for place, arrays in waiting if place is not None and arrays}:
        arrays = [a for p, group in waiting if p == place for a in group]
        xp = _arrays.array_module(arrays[0])
        with xp.cuda.Device(place[0]), xp.cuda.ExternalStream(place[1], place[0]):
            flat = xp.concatenate([a.ravel() for a in arrays]).get()
        copies[place] = iter(part.reshape(a.shape) for part, a in
                             zip(np.split(flat, np.cumsum([a.size for a in arrays])[:-1]), arrays))
    for place, arrays in waiting:
        yield [next(copies[place]) if place is not None else np.asarray(a) for a in arrays]
