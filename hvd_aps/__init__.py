"""hvd_aps: Horovod gradient compression into tiny custom float formats with Auto-Precision Scaling.

Importing hvd_aps imports neither torch nor TensorFlow; the framework adapters load on first use.
"""
from . import emulate, scaling
from .compressor import APSCompressor, TensorStats, from_name
from .config import APSConfig
from .codec import amax, decode, decode_sum, encode, pack, packed_size, quantize, unpack
from .formats import (PRESETS, FloatFormat, bf16, e2m1fn, e2m3fn, e3m0, e3m2fn, e3m4, e4m3, e4m3fn,
                      e5m2, fp16)

__version__ = "0.1.0"

__all__ = ["APSCompressor", "APSConfig", "TensorStats", "from_name", "FloatFormat", "PRESETS", "encode", "decode", "decode_sum", "quantize", "amax", "pack", "unpack",
           "packed_size", "scaling", "emulate", "e4m3", "e4m3fn", "e5m2", "e3m4", "e3m0", "e3m2fn",
           "e2m3fn", "e2m1fn", "fp16", "bf16"]
