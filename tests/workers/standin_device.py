"""What the workers that drive an entry point on the counting stand-in for CuPy share: this
process's CPU tensors taken for CUDA tensors on `place.device`, handed over on `place.stream`
(tests/counting_cupy.py counts what the package does with them), a model of many tensors, and
a step's events summed up."""
import contextlib
import functools
import hashlib
import os
import sys
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the stand-in
import counting_cupy as standin  # noqa: E402
from hvd_aps import _arrays, _device  # noqa: E402

ELEMENTS = 1 << 15  # every owner's part of each of 8 chunks at least one re-encode block on 2 ranks
FRAMEWORK_STREAM = 0xF00D  # rank r's framework hands its tensors over on stream FRAMEWORK_STREAM + r


class Tensors(torch.nn.Module):
    """`count` parameters of ELEMENTS in all, each gradient this rank's data times its own scale."""

    def __init__(self, count: int, rank: int):
        super().__init__()
        sizes = np.diff(np.linspace(0, ELEMENTS, count + 1).astype(np.int64))
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(int(n))) for n in sizes])
        self.scales = 10.0 ** np.random.default_rng(count).uniform(-6, 0, count)
        self.rank = rank

    def forward(self, step: int):
        gen = torch.Generator().manual_seed(1000 * step + self.rank)
        return sum((p * torch.randn(p.shape, generator=gen) * float(s)).sum() for p, s in zip(self.ps, self.scales))


def place_of(rank: int) -> _device.Place:
    return _device.Place(rank + 1, FRAMEWORK_STREAM + rank)


def cuda_array(x, device: int):
    """_arrays._cuda_array on the stand-in: a torch tensor is a device array sharing its memory, on
    `device` (where a CUDA tensor's array lies, whatever the calling thread's current device)."""
    if _arrays._is_cupy(x):
        return x
    if not isinstance(x, torch.Tensor):
        return None
    with standin.cupy.cuda.Device(device):
        return standin.cupy.from_dlpack(x)


@contextlib.contextmanager
def on_device(enabled: bool, place: _device.Place):
    """Inside (enabled): the stand-in for CuPy, torch tensors its device arrays, their place `place`."""
    if not enabled:
        yield
        return
    with standin.installed(), _patched(_arrays, "_cuda_array", functools.partial(cuda_array, device=place.device)), \
            _patched(_device, "place_of", lambda tensor: place if isinstance(tensor, torch.Tensor) else None):
        yield


@contextlib.contextmanager
def _patched(module, name: str, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def summary(params: np.ndarray, events: dict = None) -> dict:
    """A run's parameters' digest and, on the stand-in, its counted step: reads by the package file
    that made them, uploads, launches, CuPy's operations, the (stream, device) of the last two."""
    digest = {"digest": hashlib.sha256(params.tobytes()).hexdigest()}
    if events is None:
        return digest
    return dict(digest, reads=dict(Counter(_caller(e) for e in events["read"])), uploads=len(events["upload"]),
                launches=len(events["launch"]), ops=len(events["op"]),
                placed=sorted({(e.stream, e.device) for e in events["op"] + events["launch"]}))


def _caller(event) -> str:
    """The package file whose call read: the first frame past the array helpers."""
    return next(f for f in event.stack if not f.startswith("hvd_aps/_arrays.py")).split(":")[0]


def counted() -> dict:
    return {kind: standin.COUNTS.of(kind) for kind in standin.KINDS}
