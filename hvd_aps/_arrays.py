"""Which array library holds an array: CuPy for CUDA-resident data (taken zero-copy through
DLPack from CuPy, CUDA torch tensors and TF GPU tensors), NumPy for everything else. Internal:
the codec, the exchange stages and the framework adapters share it."""
import numpy as np


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


def array_module(a):
    """cupy for CuPy arrays, numpy otherwise: lets callers write one code path for both."""
    if _is_cupy(a):
        import cupy
        return cupy
    return np


def to_numpy(a):
    """A NumPy copy of a CuPy array; NumPy arrays as they are."""
    return a.get() if array_module(a) is not np else np.asarray(a)
