"""hvd_aps: gradient compression into tiny custom float formats with Auto-Precision Scaling, for
Horovod (PyTorch, TensorFlow, Keras 3), PyTorch DDP and FSDP2.

Importing hvd_aps imports neither torch nor TensorFlow; the framework adapters load on first use
(hvd_aps.torch, hvd_aps.tensorflow, hvd_aps.keras, hvd_aps.ddp, hvd_aps.fsdp, hvd_aps.lightning,
hvd_aps.pipelining, hvd_aps.tensor_parallel, hvd_aps.diloco), and so do torch's step profile
(hvd_aps.step_profile) and the peers' emulations (hvd_aps.peers, hvd_aps.diloco_peers).
"""
import importlib

from . import emulate, scaling
from ._owned import BlockCodes
from ._stats import TensorStats
from .codec import amax, decode, decode_sum, encode, pack, packed_size, quantize, unpack
from .compressor import APSCompressor
from .config import RECIPES, APSConfig, Fallback, Policy, Rounding, Scaling, Wire, recipe
from .formats import (PRESETS, FloatFormat, bf16, e2m1fn, e2m3fn, e3m0, e3m2fn, e3m4, e4m3, e4m3fn,
                      e5m2, fp16)

__version__ = "0.2.0"

# the framework adapters and torch's step profile, imported on first use: `import hvd_aps` then
# `hvd_aps.ddp.aps_hook`, `hvd_aps.lightning.FidelityLogger`, `hvd_aps.step_profile.measure`
_ADAPTERS = ("torch", "tensorflow", "keras", "ddp", "fsdp", "lightning", "pipelining", "tensor_parallel", "diloco",
             "step_profile", "peers", "diloco_peers")


def __getattr__(name: str):
    if name in _ADAPTERS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["APSCompressor", "APSConfig", "BlockCodes", "Rounding", "Scaling", "Wire", "Policy", "Fallback", "RECIPES", "recipe",
           "TensorStats", "FloatFormat", "PRESETS", "encode", "decode", "decode_sum", "quantize", "amax", "pack",
           "unpack", "packed_size", "scaling", "emulate", "e4m3", "e4m3fn", "e5m2", "e3m4", "e3m0", "e3m2fn",
           "e2m3fn", "e2m1fn", "fp16", "bf16"]
