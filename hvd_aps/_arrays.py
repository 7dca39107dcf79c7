"""Which array library holds an array: CuPy for CUDA-resident data (taken zero-copy through
DLPack from CuPy, CUDA torch tensors and TF GPU tensors), NumPy for everything else. Internal:
the codec, the exchange stages and the framework adapters share it."""
from typing import Any

import numpy as np

Array = Any  # a NumPy array, or a CuPy array (what the CuPy engine takes and returns)


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def _cuda_array(x):
    """x as a CuPy array when it lives on a CUDA device (zero-copy through DLPack), else None."""
    if _is_cupy(x):
        return x
    device = getattr(x, "__dlpack_device__", None)
    if device is None or device()[0] not in (2, 13):  # kDLCUDA, kDLCUDAManaged
        return None
    import cupy
    return cupy.from_dlpack(x)


def sample_stride(n, size):
    """Stride of an evenly strided sample of about `size` of n elements (size 0: all of them).
    Odd, so rows of a power-of-two width are all visited, not one column."""
    return (n // size) | 1 if size else 1


def as_array(x):
    """x as the codec sees it: a CuPy array for CUDA-resident data, a NumPy array otherwise."""
    gpu = _cuda_array(x)
    return gpu if gpu is not None else np.asarray(x)


def is_array(a) -> bool:
    """A NumPy or CuPy array (not a framework's tensor)."""
    return isinstance(a, np.ndarray) or _is_cupy(a)


def array_module(a):
    """cupy for CuPy arrays, numpy otherwise: lets callers write one code path for both."""
    if _is_cupy(a):
        import cupy
        return cupy
    return np


def to_numpy(a):
    """A NumPy copy of a CuPy array; NumPy arrays as they are."""
    return a.get() if array_module(a) is not np else np.asarray(a)


def joined(arrays):
    """One flat view over 1-D arrays that lie end to end in one allocation (a DDP bucket's
    gradients do), else None: what a copy into one buffer would give, without the copy."""
    if not arrays or any(a.ndim != 1 or not a.flags.c_contiguous or a.dtype != arrays[0].dtype for a in arrays):
        return None
    xp, size = array_module(arrays[0]), arrays[0].dtype.itemsize
    starts = [a.data.ptr if xp is not np else a.__array_interface__["data"][0] for a in arrays]
    if any(start + a.size * size != after for start, a, after in zip(starts, arrays, starts[1:])):
        return None
    total = sum(a.size for a in arrays)
    if xp is not np:
        return xp.ndarray((total,), arrays[0].dtype, memptr=arrays[0].data)
    return np.lib.stride_tricks.as_strided(arrays[0], shape=(total,), strides=(size,))


def concatenated(arrays):
    """1-D arrays of one dtype (at least one) end to end: a view where they already lie so
    (`joined`), else one copy."""
    whole = joined(arrays)
    return whole if whole is not None else array_module(arrays[0]).concatenate(arrays)
