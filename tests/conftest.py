import os

import ml_dtypes
import numpy as np
import pytest

from hvd_aps import _host_engine

# Every process the tests start prints its threads' Python stacks on a fatal signal: a collective
# library's C++ abort (SIGABRT) in a worker then says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

ENGINES = ["host", "numpy"] if _host_engine.available else ["numpy"]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Run a test once per CPU engine: the compiled ops/host.c and the NumPy implementation."""
    monkeypatch.setenv("HVD_APS_ENGINE", request.param)
    return request.param


def twin_dtype(fmt):
    """The NumPy/ml_dtypes type bit-identical to fmt, or None."""
    name = fmt.ml_dtypes_name
    if name is None:
        return None
    return np.dtype(np.float16) if name == "float16" else np.dtype(getattr(ml_dtypes, name))


def same_bits(a, b):
    """Equal float32 arrays bit for bit, where any two NaNs of the same sign count as equal."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a) & np.isnan(b) & (np.signbit(a) == np.signbit(b))
    return (a.view(np.uint32) == b.view(np.uint32)) | nan


@pytest.fixture
def counting_cupy():
    """The counting stand-in for CuPy (tests/counting_cupy.py) installed as `cupy` for the test:
    yields its Counts."""
    import counting_cupy as standin
    with standin.installed() as counts:
        yield counts
