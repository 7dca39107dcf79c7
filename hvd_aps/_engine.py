"""The engine contract: what the compiled host engine (_host_engine), the NumPy engine
(_numpy_engine) and the CuPy engine (_cupy_engine) each provide, bit for bit alike.

One call per stage over a table of blocks (hvd_aps._tables.Blocks: each block's place in the
float32 array, in a packed stream, and its stochastic index), with one exponent (and seed) per
block, on inputs checked by their caller (once per bucket layout in the exchange, per call in
hvd_aps.codec). Arrays in and out lie where the data does: on a device, what a call returns
stays there. tests/test_tables.py holds every engine to this Protocol's signatures.
"""
from typing import Optional, Protocol, Union, runtime_checkable

import numpy as np

from ._arrays import Array
from ._tables import Blocks
from .config import Rounding
from .formats import FloatFormat



@runtime_checkable
class Engine(Protocol):
    def table_amax(self, x: Array, blocks: Blocks) -> Array:
        """max |x| per block (+inf where a block holds NaN or Inf), float32."""

    def table_encode(self, x: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, rounding: Union[Rounding, str],
                     seeds: Optional[Array], saturate: bool, message: Array, residual: Optional[Array] = None) -> Array:
        """Every block's codes at its exponent into its stream in `message` (the other bits of the
        bytes they touch kept); with `residual`, what each code lost (x minus its value) there."""

    def table_sum(self, rows: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, out: Array) -> Array:
        """The ranks' codes (`rows`: (ranks, bytes)) of every block decoded at its exponent and
        added in rank order from +0.0 into `out`; returns max |sum| per block."""

    def table_decode(self, message: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, out: Array,
                     divisor: np.float32 = np.float32(1), stream: bool = False) -> Array:
        """Every block's codes decoded at its exponent, divided by `divisor` in float32, into `out`."""

    def table_shifts(self, peaks: Array, limit: float, exponents: Array) -> Array:
        """The int32 APS shift of each block from its peak (scaling.shifts_under), each also
        written as a little-endian int16 into `exponents` (2 bytes a block)."""

    def table_stats(self, x: Array, message: Array, fmt: FloatFormat, blocks: Blocks, shifts: Array, first: Array,
                    step: Array, limits: Array) -> Array:
        """(blocks, 6) float64: per block over the sample first, first + step, ...: samples,
        nonzero inputs, nonzero values sent, inputs beyond the limit, sum of (sent - input)^2,
        sum of input^2."""


CONTRACT = tuple(name for name in vars(Engine) if name.startswith("table_"))
