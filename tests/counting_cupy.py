"""A counting stand-in for CuPy: the package's GPU path (hvd_aps/_cupy_engine.py, ops/kernels.cu and
the exchange's array operations) runs on a machine without a GPU, and every device-to-host read,
host-to-device upload, allocation, CuPy operation and kernel launch is recorded with the package
frames that caused it.

Device memory is NumPy memory: an `ndarray` here wraps a NumPy array and passes for CuPy's (its
type's module starts with "cupy", which is how hvd_aps._arrays tells them). As CuPy's, it refuses
implicit conversion to NumPy and host arrays as operands, so a read or an upload the package does
not spell out fails instead of passing unseen. `RawModule` parses the `extern "C"` kernels'
signatures from the source it is given, checks every launch's arguments against them (a pointer
takes a device array of the pointee's dtype on the launch's device, a scalar the NumPy scalar of
its C type) and runs the kernel itself: ops/kernels.cu compiled for the CPU by tests/simt.py, on
the memory the pointers reach.

Use `installed()` (or the `counting_cupy` fixture of conftest.py): it makes this stand-in `cupy`,
`cupy.cuda`, `cupy.cuda.runtime` and `cupyx` for the package and yields the `Counts`.
"""
import contextlib
import dataclasses
import functools
import itertools
import operator
import os
import sys
import threading
import types
import weakref
from collections import Counter

import numpy as np

import hvd_aps
import simt

_PACKAGE = os.path.dirname(os.path.abspath(hvd_aps.__file__)) + os.sep
_REPO = os.path.dirname(os.path.dirname(_PACKAGE))
_HERE = os.path.abspath(__file__)
DEVICE_COUNT = 8  # devices runtime.getDeviceCount() reports: enough for one per thread rank


# What happened on the device ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Event:
    """One device event. stack: the package frames that caused it, innermost first ("hvd_aps/x.py:12
    fn"), or where none was on the stack the caller's own frame."""
    kind: str    # read, upload, alloc, op (CuPy's own kernels), launch (a RawModule kernel)
    name: str    # what: "get", "__float__", "asarray", "setitem", a kernel's name, ...
    nbytes: int
    stack: tuple
    rank: object  # the tag of the thread it happened in (Counts.rank)
    stream: int = None  # ops and launches: the stream's handle and the device they ran on
    device: int = None
    grid: tuple = None  # launches
    block: tuple = None

    @property
    def where(self) -> str:
        return " <- ".join(self.stack[:3])


KINDS = {"read": "reads", "upload": "uploads", "alloc": "allocations", "op": "ops", "launch": "launches"}


class Counts:
    """The device events since reset(), from every thread. Tag a thread's events with rank()."""

    def __init__(self):
        self._lock, self._tag, self.events = threading.Lock(), threading.local(), []

    def reset(self) -> None:
        with self._lock:
            self.events = []

    @contextlib.contextmanager
    def rank(self, tag):
        """This thread's events tagged `tag` (a thread rank)."""
        before, self._tag.value = getattr(self._tag, "value", None), tag
        try:
            yield
        finally:
            self._tag.value = before

    def record(self, kind: str, name: str, nbytes: int = 0, **device) -> None:
        event = Event(kind, name, int(nbytes), _stack(), getattr(self._tag, "value", None), **device)
        with self._lock:
            self.events.append(event)

    def of(self, kind: str, rank=None) -> list:
        """The events of one kind (of one rank's thread, where given)."""
        with self._lock:
            return [e for e in self.events if e.kind == kind and (rank is None or e.rank == rank)]

    @property
    def reads(self) -> list:
        return self.of("read")

    @property
    def uploads(self) -> list:
        return self.of("upload")

    @property
    def allocations(self) -> list:
        return self.of("alloc")

    @property
    def ops(self) -> list:
        return self.of("op")

    @property
    def launches(self) -> list:
        return self.of("launch")

    def summary(self, rank=None) -> str:
        """Each kind's count and bytes, then each distinct (kind, name, frames) with how often."""
        lines, seen = [], Counter()
        for kind, label in KINDS.items():
            events = self.of(kind, rank)
            lines.append(f"{label:11} {len(events):6d}  {sum(e.nbytes for e in events):10d} bytes")
            seen.update((kind, e.name, e.where) for e in events)
        lines += [f"  {n:5d} x {kind:6} {name:18} {where}" for (kind, name, where), n in sorted(seen.items())]
        return "\n".join(lines)


COUNTS = Counts()


def _stack() -> tuple:
    frames, caller = [], None
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            frames.append(f"{os.path.relpath(name, _REPO)}:{frame.f_lineno} {frame.f_code.co_name}")
        elif caller is None and name != _HERE:
            caller = f"{os.path.relpath(name, _REPO)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return tuple(frames) or (caller,)


# Devices and streams: current values of a thread, as CuPy's ----------------------------------------
class DeviceSynchronized(RuntimeError):
    """A read inside cupyx.allow_synchronize(False)."""


class StreamOrderError(RuntimeError):
    """Device memory uploaded on one stream, read on another that is not ordered after the upload."""


class _Order:
    """Which uploads each stream is ordered after. The stand-in runs every copy at once, so a hazard
    is checked, not suffered: on a device a host-to-device copy lands when its stream gets to it,
    and another stream sees it only after waiting for an event recorded behind it, or after the
    host synchronised with its stream before queueing the read."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queued = Counter()          # stream -> uploads queued on it so far
        self.waited = {}                 # stream -> {other stream: its uploads this one waits for}
        self.synced = Counter()          # stream -> its uploads the host has seen complete
        self.uploads = {}                # id(an upload's allocation) -> (stream, its place on it)

    def upload(self, allocation: np.ndarray) -> None:
        stream = _current.stream.ptr
        with self.lock:
            self.queued[stream] += 1
            self.uploads[id(allocation)] = (stream, self.queued[stream])
        weakref.finalize(allocation, self.uploads.pop, id(allocation), None)

    def point(self, stream: int) -> tuple:
        with self.lock:
            return stream, self.queued[stream]

    def wait(self, stream: int, point: tuple) -> None:
        other, count = point
        with self.lock:
            waited = self.waited.setdefault(stream, {})
            waited[other] = max(waited.get(other, 0), count)

    def synchronize(self, stream: int) -> None:
        with self.lock:
            self.synced[stream] = self.queued[stream]

    def check(self, what: str, array: "ndarray") -> None:
        """Raise unless the current stream may read `array`'s memory now."""
        reader = _current.stream.ptr
        with self.lock:
            uploaded = self.uploads.get(id(_root(array._a)))
            if uploaded is None or uploaded[0] == reader:
                return
            stream, count = uploaded
            if self.waited.get(reader, {}).get(stream, 0) >= count or self.synced[stream] >= count:
                return
        raise StreamOrderError(f"{what} on stream {reader:#x} reads memory uploaded on stream {stream:#x}, "
                               f"which it neither waited for (an event) nor the host synchronised with")

    def reset(self) -> None:
        with self.lock:
            self.queued.clear(), self.waited.clear(), self.synced.clear(), self.uploads.clear()


ORDER = _Order()


class CudaEvent:
    """cupy.cuda.Event: a point in a stream's queue that other streams (wait_event) and the host
    (synchronize) can wait for."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.at = None

    def record(self, stream: "Stream" = None) -> None:
        self.at = ORDER.point((stream or _current.stream).ptr)

    def synchronize(self) -> None:
        if self.at is not None:
            ORDER.synchronize(self.at[0])


class Stream:
    """A CUDA stream: `ptr` its handle (0: the null stream); current in a thread inside `with`."""
    _handles = itertools.count(0x1000, 0x10)

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else next(Stream._handles)

    def __enter__(self):
        _current.streams.append(_current.stream)
        _current.stream = self
        return self

    def __exit__(self, *exc):
        _current.stream = _current.streams.pop()

    def use(self):
        _current.stream = self
        return self

    def synchronize(self) -> None:
        """Work on this stand-in is done when it returns; the host has seen this stream's uploads."""
        ORDER.synchronize(self.ptr)

    def wait_event(self, event: CudaEvent) -> None:
        """What this stream queues from now on runs after the event's point."""
        if event.at is not None:
            ORDER.wait(self.ptr, event.at)


class ExternalStream(Stream):
    """A stream made elsewhere (a framework's), known by its handle."""

    def __init__(self, ptr: int, device_id: int = -1):
        self.ptr = int(ptr)


class Device:
    """A CUDA device by number (default: the current one); current in a thread inside `with`."""

    def __init__(self, device=None):
        self.id = _current.device if device is None else int(device)
        if not 0 <= self.id < DEVICE_COUNT:
            raise ValueError(f"no device {self.id}: the stand-in has {DEVICE_COUNT}")

    def __enter__(self):
        _current.devices.append(_current.device)
        _current.device = self.id
        return self

    def __exit__(self, *exc):
        _current.device = _current.devices.pop()

    def use(self) -> None:
        _current.device = self.id

    def synchronize(self) -> None:
        """Work on this stand-in is done when it returns; the host has seen every stream's uploads."""
        for stream in list(ORDER.queued):
            ORDER.synchronize(stream)


Stream.null = Stream(null=True)


class _Current(threading.local):
    """A thread's current device and stream (and those its `with` blocks will restore), and
    whether it may read (cupyx.allow_synchronize)."""

    def __init__(self):
        self.device, self.stream, self.devices, self.streams, self.synchronize = 0, Stream.null, [], [], True


_current = _Current()


def get_current_stream(device_id: int = -1) -> Stream:
    return _current.stream


@contextlib.contextmanager
def allow_synchronize(allow: bool):
    """cupyx.allow_synchronize: inside (allow False), any read raises DeviceSynchronized."""
    before, _current.synchronize = _current.synchronize, allow
    try:
        yield
    finally:
        _current.synchronize = before


def _on_device() -> dict:
    return {"stream": _current.stream.ptr, "device": _current.device}


# Arrays ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryPointer:
    """A device address: the allocation it lies in (a NumPy array's memory) and its place."""
    owner: np.ndarray
    ptr: int
    device_id: int

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self.owner, self.ptr + int(offset), self.device_id)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _read(name: str, nbytes: int) -> None:
    """A device-to-host copy on the current stream: the host waits for the stream's work."""
    if not _current.synchronize:
        raise DeviceSynchronized(f"{name}: a device-to-host read inside cupyx.allow_synchronize(False)")
    COUNTS.record("read", name, nbytes)
    ORDER.synchronize(_current.stream.ptr)


class ndarray:
    """A device array: a NumPy array standing for device memory, on one device."""

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        """CuPy's constructor: a new allocation, or a view of the memory at `memptr`."""
        if memptr is None:
            a = np.empty(shape, dtype, order=order)
            COUNTS.record("alloc", "ndarray", a.nbytes)
        else:  # NumPy checks the view lies inside the allocation
            a = np.ndarray(shape, dtype, buffer=memptr.owner, offset=memptr.ptr - _address(memptr.owner),
                           strides=strides)
        self._a, self._device = a, _current.device if memptr is None else memptr.device_id

    # what an array is
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(_root(self._a), _address(self._a), self._device)

    @property
    def device(self) -> Device:
        return Device(self._device)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:  # no read: a failing assertion's message leaves the counts as they are
        return f"counting_cupy.ndarray(shape={self.shape}, dtype={self.dtype}, device={self._device})"

    # reads
    def get(self, stream=None, order="C", out=None):
        _read("get", self.nbytes)
        return self._a.copy()

    def item(self):
        _read("item", self.itemsize)
        return self._a.item()

    def tolist(self):
        _read("tolist", self.nbytes)
        return self._a.tolist()

    def __float__(self):
        _read("__float__", self.itemsize)
        return float(self._a)

    def __int__(self):
        _read("__int__", self.itemsize)
        return int(self._a)

    def __bool__(self):
        _read("__bool__", self.itemsize)
        return bool(self._a)

    def __index__(self):
        _read("__index__", self.itemsize)
        return operator.index(self._a)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    # DLPack: the NumPy memory's, so torch.from_dlpack gives a CPU tensor sharing it
    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    # indexing
    def __getitem__(self, index):
        index = _index(index)
        result = self._a[index]
        if not isinstance(result, np.ndarray):  # CuPy keeps an element on the device, as a 0-d array
            result = self._a[(index if isinstance(index, tuple) else (index,)) + (Ellipsis,)]
        return _result(result, [self], "getitem")

    def __setitem__(self, index, value):
        self._a[_index(index)] = _value(value)
        COUNTS.record("op", "setitem", **_on_device())

    # views and copies
    def view(self, dtype=None):
        return _wrap(self._a.view() if dtype is None else self._a.view(dtype), self._device)

    def reshape(self, *shape, order="C"):
        return _result(self._a.reshape(*shape, order=order), [self], "reshape")

    def ravel(self, order="C"):
        return _result(self._a.ravel(order), [self], "ravel")

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _result(self._a.astype(dtype, order=order), [self], "astype")

    def copy(self, order="C"):
        return _result(self._a.copy(order), [self], "copy")

    def fill(self, value) -> None:
        self._a.fill(_value(value))
        COUNTS.record("op", "fill", **_on_device())

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """NumPy's ufuncs on device arrays run on the device, as CuPy's do."""
        name = ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}"
        return _device_call(name, getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        """NumPy's functions on device arrays run on the device, as CuPy's do."""
        return _device_call(func.__name__, func, args, kwargs)


ndarray.__module__ = "cupy._core.core"  # what hvd_aps._arrays._is_cupy looks at


def _reduction(name: str):
    function = getattr(np, name)
    return lambda self, *args, **kwargs: _device_call(name, function, (self,) + args, kwargs)


def _operator(ufunc, reflected: bool = False, inplace: bool = False):
    def method(self, other):
        if inplace:
            return _device_call(ufunc.__name__, ufunc, (self, other), {"out": self})
        return _device_call(ufunc.__name__, ufunc, (other, self) if reflected else (self, other), {})
    return method


for _name in ("max", "min", "sum", "mean", "any", "all"):
    setattr(ndarray, _name, _reduction(_name))
for _name, _ufunc in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                      ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power),
                      ("lshift", np.left_shift), ("rshift", np.right_shift), ("and", np.bitwise_and),
                      ("or", np.bitwise_or), ("xor", np.bitwise_xor)]:
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_name}__", _operator(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _operator(_ufunc, inplace=True))
for _name, _ufunc in [("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal),
                      ("gt", np.greater), ("ge", np.greater_equal)]:
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
for _name, _ufunc in [("neg", np.negative), ("pos", np.positive), ("abs", np.absolute), ("invert", np.invert)]:
    setattr(ndarray, f"__{_name}__", lambda self, ufunc=_ufunc: _device_call(ufunc.__name__, ufunc, (self,), {}))
ndarray.__hash__ = None  # unhashable, as NumPy's and CuPy's arrays are
del _name, _ufunc


def _wrap(a: np.ndarray, device: int = None) -> ndarray:
    array = object.__new__(ndarray)
    array._a, array._device = a, _current.device if device is None else device
    return array


def _result(result, inputs: list, name: str):
    """A NumPy result of an operation on device arrays, on the device: an input itself, a view of
    one, or a new allocation (counted, with the operation that made it). Tuples element by
    element; scalars as 0-d arrays, as CuPy's results are."""
    if isinstance(result, tuple):
        return tuple(_result(r, inputs, name) for r in result)
    if not isinstance(result, (np.ndarray, np.generic, int, float, bool)):
        return result
    for array in inputs:
        if result is array._a:
            return array
    if isinstance(result, np.ndarray) and any(_root(result) is _root(a._a) for a in inputs):
        return _wrap(result, inputs[0]._device)
    result = np.asarray(result)
    COUNTS.record("op", name, **_on_device())
    COUNTS.record("alloc", name, result.nbytes)
    return _wrap(result)


def _unwrap(x, inputs: list):
    """An operand as NumPy sees it: a device array's memory (noted in `inputs`); a host array
    refused, as CuPy refuses it (0-d ones pass, as scalars)."""
    if isinstance(x, ndarray):
        ORDER.check("an operation", x)
        inputs.append(x)
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(item, inputs) for item in x)
    if isinstance(x, np.ndarray):
        if x.ndim:
            raise TypeError(f"Unsupported type {type(x)}")
        return x[()]
    return x


def _device_call(name: str, function, args, kwargs):
    """NumPy's `function` as CuPy's: on device arrays, into `out` or a new one (counted)."""
    inputs = []
    args = _unwrap(tuple(args), inputs)
    kwargs = {k: _unwrap(v, inputs) for k, v in kwargs.items()}
    result = function(*args, **kwargs)
    if kwargs.get("out") is not None:
        COUNTS.record("op", name, **_on_device())
    return _result(result, inputs, name)


def _host(x, name: str):
    """Host data bound for the device (an index, a value): a NumPy copy, counted as an upload."""
    host = np.array(x)
    COUNTS.record("upload", name, host.nbytes)
    ORDER.upload(host)
    return host


def _index(index):
    """An index as NumPy takes it: device arrays' memory, host arrays and lists uploaded."""
    if isinstance(index, tuple):
        return tuple(_index(i) for i in index)
    if isinstance(index, ndarray):
        ORDER.check("indexing", index)
        return index._a
    if isinstance(index, list) or isinstance(index, np.ndarray) and index.ndim:
        return _host(index, "index")
    return index


def _value(value):
    """A value written into a device array: a device array's memory, host arrays uploaded."""
    if isinstance(value, ndarray):
        ORDER.check("an assignment", value)
        return value._a
    if isinstance(value, list) or isinstance(value, np.ndarray) and value.ndim:
        return _host(value, "value")
    return value


# cupy's functions -----------------------------------------------------------------------------------
def _allocated(name: str, a: np.ndarray) -> ndarray:
    COUNTS.record("alloc", name, a.nbytes)
    return _wrap(a)


def _uploaded(name: str, data, dtype) -> ndarray:
    host = np.array(data, dtype=dtype, copy=True)
    COUNTS.record("upload", name, host.nbytes)
    ORDER.upload(host)
    return _allocated(name, host)


def _like(a):
    """What a *_like function takes its shape and dtype from."""
    return a._a if isinstance(a, ndarray) else a


def asarray(a, dtype=None, order=None, *, blocking=False) -> ndarray:
    if isinstance(a, ndarray):
        return a.astype(a.dtype if dtype is None else dtype, copy=False)
    return _uploaded("asarray", a, dtype)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0) -> ndarray:
    if isinstance(obj, ndarray):
        return obj.astype(obj.dtype if dtype is None else dtype, copy=copy)
    return _uploaded("array", obj, dtype)


def ascontiguousarray(a, dtype=None) -> ndarray:
    if not isinstance(a, ndarray):
        return _uploaded("ascontiguousarray", np.ascontiguousarray(a), dtype)
    return _device_call("ascontiguousarray", np.ascontiguousarray, (a,), {"dtype": dtype})


def asnumpy(a, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
    if not isinstance(a, ndarray):
        return np.asarray(a)
    _read("asnumpy", a.nbytes)
    return a._a.copy()


def from_dlpack(x) -> ndarray:
    """A device array sharing x's memory: x a device array, or a CPU tensor standing for a
    device's (this stand-in's device memory is host memory). No copy, not counted."""
    return x.view() if isinstance(x, ndarray) else _wrap(np.from_dlpack(x))


def empty(shape, dtype=float, order="C") -> ndarray:
    return _allocated("empty", np.empty(shape, dtype, order))


def zeros(shape, dtype=float, order="C") -> ndarray:
    return _allocated("zeros", np.zeros(shape, dtype, order))


def ones(shape, dtype=float, order="C") -> ndarray:
    return _allocated("ones", np.ones(shape, dtype, order))


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    return _allocated("full", np.full(shape, _value(fill_value), dtype, order))


def empty_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _allocated("empty_like", np.empty_like(_like(a), dtype, order, shape=shape))


def zeros_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _allocated("zeros_like", np.zeros_like(_like(a), dtype, order, shape=shape))


def ones_like(a, dtype=None, order="K", shape=None) -> ndarray:
    return _allocated("ones_like", np.ones_like(_like(a), dtype, order, shape=shape))


def full_like(a, fill_value, dtype=None, order="K", shape=None) -> ndarray:
    return _allocated("full_like", np.full_like(_like(a), _value(fill_value), dtype, order, shape=shape))


def arange(start, stop=None, step=None, dtype=None) -> ndarray:
    return _allocated("arange", np.arange(start, stop, step, dtype=dtype))


def scatter_add(a: ndarray, slices, value) -> None:
    """cupyx.scatter_add: a[slices] += value, repeated indices adding up (np.add.at)."""
    np.add.at(a._a, _index(slices), _value(value))
    COUNTS.record("op", "scatter_add", **_on_device())


def scatter_max(a: ndarray, slices, value) -> None:
    np.maximum.at(a._a, _index(slices), _value(value))
    COUNTS.record("op", "scatter_max", **_on_device())


@functools.lru_cache(maxsize=None)
def _numpy_attribute(name: str):
    """cupy.<name> for what is not defined here: NumPy's dtypes and constants as they are, its
    functions run on the device (device arrays in and out, host arrays refused)."""
    target = getattr(np, name)
    if isinstance(target, type) or not callable(target):
        return target
    return functools.wraps(target)(lambda *args, **kwargs: _device_call(name, target, args, kwargs))


# Kernels --------------------------------------------------------------------------------------------
class RawModule:
    """CUDA source as CuPy compiles it: each `extern "C"` kernel of ops/kernels.cu launched on the
    CPU through the SIMT layer (tests/simt.py), its own text running thread for thread."""

    def __init__(self, code: str = None, options: tuple = (), **kwargs):
        self.code, self.options, self._kernels = code, tuple(options), simt.signatures(code)
        if self._kernels != simt.KERNELS.kernels:
            raise ValueError("the stand-in runs ops/kernels.cu as it is on disk, not other source")

    def get_function(self, name: str) -> "RawKernel":
        if name not in self._kernels:
            raise LookupError(f"no kernel {name!r} in the module's source")
        return RawKernel(name, self._kernels[name])


class RawKernel:
    def __init__(self, name: str, parameters: tuple):
        self.name, self.parameters = name, parameters

    def __call__(self, grid, block, args, shared_mem: int = 0, stream: Stream = None) -> None:
        """Checks the arguments against the signature, records the launch (on `stream`, else the
        thread's current one) and runs the kernel."""
        grid, block = tuple(np.atleast_1d(grid).tolist()), tuple(np.atleast_1d(block).tolist())
        if len(args) != len(self.parameters):
            raise TypeError(f"{self.name} takes {len(self.parameters)} arguments, got {len(args)}")
        if min(grid) < 1 or not 1 <= int(np.prod(block)) <= 1024:
            raise ValueError(f"{self.name}: grid {grid}, block {block}")
        arguments = [self._argument(p, a) for p, a in zip(self.parameters, args)]
        COUNTS.record("launch", self.name, stream=(stream or _current.stream).ptr, device=_current.device,
                      grid=grid, block=block)
        simt.KERNELS.launch(self.name, grid, block, arguments)

    def _argument(self, parameter: simt.Parameter, arg):
        """A device array as the bytes it spans; a null pointer as None; a scalar as it is."""
        if parameter.pointer:
            if isinstance(arg, ndarray):
                if arg.dtype != parameter.dtype or arg._device != _current.device:
                    raise TypeError(f"{self.name}: {parameter.name} takes {parameter.dtype} on device "
                                    f"{_current.device}, got {arg.dtype} on device {arg._device}")
                ORDER.check(f"{self.name}'s {parameter.name}", arg)
                return simt.KERNELS.span(self.name, parameter, arg._a)
            if isinstance(arg, np.generic) and arg.dtype.kind in "iu" and arg == 0:
                return None
        elif isinstance(arg, np.generic) and arg.dtype == parameter.dtype:
            return arg
        raise TypeError(f"{self.name}: {parameter.name} takes {'a device array of ' * parameter.pointer}"
                        f"{parameter.dtype}, got {type(arg).__name__} {getattr(arg, 'dtype', '')}")


# The modules ----------------------------------------------------------------------------------------
def _module(name: str, doc: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attributes)
    return module


runtime = _module("cupy.cuda.runtime", "CUDA's runtime calls the package makes.",
                  getDevice=lambda: _current.device, setDevice=lambda device: Device(device).use(),
                  getDeviceCount=lambda: DEVICE_COUNT,
                  getDeviceProperties=lambda device: {"name": b"counting_cupy stand-in"})
cuda = _module("cupy.cuda", "Devices, streams and memory.", Device=Device, Stream=Stream, ExternalStream=ExternalStream,
               Event=CudaEvent,
               get_current_stream=get_current_stream, MemoryPointer=MemoryPointer, runtime=runtime)
cupyx = _module("cupyx", "cupyx's scatter functions and synchronisation guard.", scatter_add=scatter_add,
                scatter_max=scatter_max, allow_synchronize=allow_synchronize, DeviceSynchronized=DeviceSynchronized)
cupy = _module("cupy", __doc__, ndarray=ndarray, asarray=asarray, array=array, ascontiguousarray=ascontiguousarray,
               asnumpy=asnumpy, from_dlpack=from_dlpack, empty=empty, zeros=zeros, ones=ones, full=full,
               empty_like=empty_like, zeros_like=zeros_like, ones_like=ones_like, full_like=full_like, arange=arange,
               RawModule=RawModule, cuda=cuda, __getattr__=_numpy_attribute)
_MODULES = {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupyx": cupyx}
_ABSENT = object()


@contextlib.contextmanager
def installed():
    """The stand-in as CuPy while inside: hvd_aps._cupy_engine imports anew against it, and
    everything (a real CuPy's modules included) is as it was afterwards. Yields COUNTS, reset."""
    names = list(_MODULES) + ["hvd_aps._cupy_engine"]
    saved = {name: sys.modules.get(name, _ABSENT) for name in names}
    engine = hvd_aps.__dict__.pop("_cupy_engine", _ABSENT)  # `from . import _cupy_engine` looks here first
    sys.modules.update(_MODULES)
    sys.modules.pop("hvd_aps._cupy_engine", None)
    COUNTS.reset()
    ORDER.reset()
    try:
        yield COUNTS
    finally:
        hvd_aps.__dict__.pop("_cupy_engine", None)
        if engine is not _ABSENT:
            hvd_aps._cupy_engine = engine
        for name, module in saved.items():
            if module is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def peek(a) -> np.ndarray:
    """A copy of a device array's memory for a test's own checks, not counted as a read."""
    return a._a.copy() if isinstance(a, ndarray) else np.array(a)


def on_device(a: np.ndarray) -> ndarray:
    """A copy of host data on the current device, not counted: what a collective delivers."""
    return _wrap(np.array(a, copy=True))
