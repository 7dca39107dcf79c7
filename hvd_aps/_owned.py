"""Codes of values one rank owns (FSDP2's parameter shards in an all-gather, a pipeline stage's
activations in a send): every block scaled by its own power of two; no collectives here.

A gather or a point-to-point send moves values that the sender alone holds, so, unlike a sum,
nothing has to be agreed first: every block of `block` elements is scaled by the largest power of
two that keeps its own max within the format (APS over one rank), and its exponent travels with
its codes. One message a sender: its codes packed as codec.pack lays them, then one little-endian
int16 exponent per block. Every receiver decodes a message alike, so every rank holds the same
values; the values sent are only rounded in the copy the receiver fills, never where they came
from. Rounding to nearest: a value's copy is the same whenever it is sent. Three engine calls
encode a message and one decodes any number of them.
"""
import dataclasses
import functools
from typing import Union

import numpy as np

from . import _arrays, _tables, codec, scaling
from ._layout import BLOCK
from .config import Rounding
from .formats import FloatFormat

EXPONENT = _tables.EXPONENT  # as the codes exchange's re-encode carries them
ALIGN = 4  # the exponents start at a multiple of this many bytes of a message


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """How values one rank owns travel: in `fmt`, each block of `block` elements (at most
    hvd_aps._tables.RUN_ROW) at its own power-of-two scale.

    Attributes:
        fmt: the FloatFormat (given as one or by its name: "e4m3", "e5m2", "e2m1fn", ...).
        block: elements per exponent (2 bytes of it a block: 0.1 % of 8-bit codes at the default
            2048; small blocks follow a tensor's magnitudes closer, as MX formats' 32 do).
    """
    fmt: FloatFormat
    block: int = BLOCK

    def __post_init__(self):
        object.__setattr__(self, "fmt", FloatFormat.parse(self.fmt))
        block = self.block
        if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= _tables.RUN_ROW:
            raise ValueError(f"block must be an int in 1..{_tables.RUN_ROW} (elements per exponent), got {block!r}")

    @classmethod
    def parse(cls, codes: Union["BlockCodes", FloatFormat, str]) -> "BlockCodes":
        """A BlockCodes, or one at the default block for a format or its name."""
        return codes if isinstance(codes, cls) else cls(codes)

    def blocks(self, n: int) -> int:
        """Exponents a message of n values carries."""
        return -(-n // self.block)

    def exponents_at(self, n: int) -> int:
        """Where a message of n values holds its exponents: after its codes, aligned."""
        return -(-self.fmt.packed_size(n) // ALIGN) * ALIGN

    def message_bytes(self, n: int) -> int:
        """Bytes of one rank's message of n values."""
        return self.exponents_at(n) + EXPONENT.itemsize * self.blocks(n)

    def encode(self, x, message):
        """Flat float32 x (NumPy, or CuPy on a device) into `message` (uint8, message_bytes(x.size),
        where x lies) -> message."""
        table, engine = _tables.run(x.size, self.block), codec.engine_for(x)
        at = self.exponents_at(x.size)
        message[self.fmt.packed_size(x.size):at] = 0  # the padding, and a packed stream's unused last bits
        if x.size:
            if self.fmt.bits % 8:
                message[self.fmt.packed_size(x.size) - 1] = 0
            exponents = message[at:]
            shifts = engine.table_shifts(engine.table_amax(x, table), scaling.limit_for(1, self.fmt), exponents)
            engine.table_encode(x, self.fmt, table, shifts, Rounding.NEAREST, None, False, message)
        return message

    def decode(self, gathered, n: int, out):
        """Messages of n values each end to end (`gathered`: k x message_bytes(n) uint8: every
        rank's, as an all-gather gives them) -> their values in `out` (k x n float32, flat), one
        message after another."""
        world = out.size // n if n else 0
        if world * n != out.size or gathered.size != world * self.message_bytes(n):
            raise ValueError(f"{out.size} values of messages of {n} need {out.size // max(n, 1)} messages of "
                             f"{self.message_bytes(n)} bytes, got {gathered.size} bytes")
        if not world:
            return out
        rows = gathered.reshape(world, self.message_bytes(n))
        at = self.exponents_at(n)
        xp = _arrays.array_module(gathered)
        exponents = xp.ascontiguousarray(rows[:, at:]).view(EXPONENT).reshape(-1)
        table = _gathered(world, n, self.block, self.message_bytes(n))
        codec.engine_for(gathered).table_decode(rows.reshape(-1), self.fmt, table, exponents, out, np.float32(1), False)
        return out


@functools.lru_cache(maxsize=_tables.RUNS_KEPT)
def _gathered(world: int, n: int, block: int, message: int) -> "_tables.Blocks":
    """The table of `world` messages of n values end to end: rank r's blocks read its message
    (at byte r * message) and write out[r * n:]; block k of rank r takes exponent r * blocks + k."""
    one, per = _tables.run(n, block), -(-n // block)
    rows = np.concatenate([one.rows + np.array([r * n, 0, r * message, 0, 0], np.int64) for r in range(world)])
    owner = np.concatenate([one.tensor + r * per for r in range(world)])
    return _tables.Blocks.of(*(rows[:, c] for c in range(_tables.COLUMNS)), owner, owner)
