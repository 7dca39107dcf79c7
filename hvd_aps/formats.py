"""Custom floating-point formats: a small immutable value describing a sign/exponent/mantissa split.

Names follow ml_dtypes' suffixes so that `e4m3` here is `ml_dtypes.float8_e4m3` and `e4m3fn` is
`ml_dtypes.float8_e4m3fn`; the codec is tested bit for bit against every format ml_dtypes has.
"""
import dataclasses
import math
import re
from typing import Optional, Union

from ._choice import Choice


class Variant(Choice):
    """What a format's top codes hold."""
    IEEE = "ieee"  # Inf and NaN in the top exponent (IEEE 754)
    FN = "fn"      # finite only (OCP): one NaN code at 8 bits or more, none below

_NAME = re.compile(r"^e(\d+)m(\d+)(fn)?$")
_ALIASES = {"fp16": "e5m10", "bf16": "e8m7"}

# Policy numbers shared with ops/fpcodec.h.
IEEE, FN_NAN, FINITE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with 1 sign bit, `exp_bits` and `man_bits`.

    variant "ieee": the top exponent holds Inf and NaN (IEEE 754; float8_e4m3, float8_e5m2).
    With man_bits=0 there is no NaN code, so NaN encodes as Inf of the same sign.
    variant "fn": finite only, following OCP: formats of 8 bits or more keep one NaN (the
    all-ones magnitude, float8_e4m3fn); narrower ones have no NaN at all (float4_e2m1fn), every
    code is a number and overflow saturates.
    """

    exp_bits: int
    man_bits: int
    variant: Variant = Variant.IEEE

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", Variant.parse(self.variant, "variant"))
        for name in ("exp_bits", "man_bits"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        if not 1 <= self.exp_bits <= 8:
            raise ValueError(f"exp_bits must be in 1..8, got {self.exp_bits}")
        if not 0 <= self.man_bits <= 23:
            raise ValueError(f"man_bits must be in 0..23, got {self.man_bits}")
        if self.bits > 16:
            raise ValueError(f"a format has at most 16 bits (1 sign + exp + man), {self} has {self.bits}")
        if self.max_code <= 0:
            raise ValueError(f"{self} has no finite nonzero value")

    @classmethod
    def parse(cls, name: Union["FloatFormat", str]) -> "FloatFormat":
        """Build a format from a name: "e4m3", "e4m3fn", "e3m0", "fp16", "bf16"."""
        if isinstance(name, FloatFormat):
            return name
        if not isinstance(name, str):
            raise TypeError(f"a format name must be a str, got {type(name).__name__}")
        key = _ALIASES.get(name.strip().lower(), name.strip().lower())
        match = _NAME.match(key)
        if match is None:
            raise ValueError(f"unknown format {name!r}: expected 'e<exp>m<man>' with optional 'fn' "
                             f"suffix (e.g. e4m3, e4m3fn, e3m0) or one of {sorted(_ALIASES)}")
        return cls(int(match[1]), int(match[2]), Variant.FN if match[3] else Variant.IEEE)

    def __str__(self) -> str:
        return f"e{self.exp_bits}m{self.man_bits}{'fn' if self.variant is Variant.FN else ''}"

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    def packed_size(self, n: int) -> int:
        """Bytes that `n` codes take packed end to end (codec.pack)."""
        return -(-n * self.bits // 8)

    @property
    def code_dtype(self) -> str:
        """NumPy dtype name of one code: uint8 up to 8 bits, uint16 above."""
        return "uint8" if self.bits <= 8 else "uint16"

    @property
    def fits_float16(self) -> bool:
        """Whether float16 holds every value of the format exactly (all 8-bit-and-below formats)."""
        return self.exp_bits <= 5 and self.man_bits <= 10 and self.max <= 65504.0

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def policy(self) -> int:
        """Special-value policy number used by the kernels (IEEE, FN_NAN or FINITE)."""
        if self.variant is Variant.IEEE:
            return IEEE
        return FN_NAN if self.bits >= 8 else FINITE

    @property
    def has_inf(self) -> bool:
        return self.policy == IEEE

    @property
    def has_nan(self) -> bool:
        return self.policy == FN_NAN or (self.policy == IEEE and self.man_bits > 0)

    @property
    def max_code(self) -> int:
        """Largest finite magnitude code (sign bit clear)."""
        all_ones = (1 << (self.exp_bits + self.man_bits)) - 1
        return {IEEE: all_ones - (1 << self.man_bits), FN_NAN: all_ones - 1, FINITE: all_ones}[self.policy]

    @property
    def max(self) -> float:
        exp_field, man = divmod(self.max_code, 1 << self.man_bits)
        if exp_field == 0:  # only e1mX ieee: its one finite binade is subnormal
            return man / (1 << self.man_bits) * self.min_normal
        return (1 + man / (1 << self.man_bits)) * 2.0 ** (exp_field - self.bias)

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.man_bits)

    @property
    def max_exponent(self) -> int:
        """floor(log2(max)): the largest power of two the format holds."""
        return math.frexp(self.max)[1] - 1

    @property
    def max_ulp(self) -> float:
        """Spacing of the grid at max: where the next value would be, had the format one."""
        return 2.0 ** (max(self.max_exponent, 1 - self.bias) - self.man_bits)

    @property
    def ml_dtypes_name(self) -> Optional[str]:
        """Name of the bit-identical ml_dtypes/NumPy type, or None where ml_dtypes has none."""
        return _TWINS.get(self)


e4m3 = FloatFormat(4, 3)
e4m3fn = FloatFormat(4, 3, "fn")
e5m2 = FloatFormat(5, 2)
e3m4 = FloatFormat(3, 4)
e3m0 = FloatFormat(3, 0)
e3m2fn = FloatFormat(3, 2, "fn")
e2m3fn = FloatFormat(2, 3, "fn")
e2m1fn = FloatFormat(2, 1, "fn")
fp16 = FloatFormat(5, 10)
bf16 = FloatFormat(8, 7)

PRESETS = {**{str(f): f for f in (e4m3, e4m3fn, e5m2, e3m4, e3m0, e3m2fn, e2m3fn, e2m1fn)},
           "fp16": fp16, "bf16": bf16}

_TWINS = {e4m3: "float8_e4m3", e4m3fn: "float8_e4m3fn", e5m2: "float8_e5m2", e3m4: "float8_e3m4",
          e3m2fn: "float6_e3m2fn", e2m3fn: "float6_e2m3fn", e2m1fn: "float4_e2m1fn",
          fp16: "float16", bf16: "bfloat16"}
