"""Exact one-process emulations of the low-precision allreduces a GPU user picks instead of hvd_aps
(NCCL's ring and tree in bf16/fp16/FP8, torch's bf16/fp16 DDP hooks, FP8 with APS's shared scale),
and of hvd_aps's codes exchange at any N: N float32 arrays -> the float32 result every rank gets,
rounding for rounding, as NCCL 5067397c and PyTorch 38dfbe6f compute it (the functions cite lines).

- FuncSum (src/device/reduce_kernel.h): half and bfloat16 add exactly, rounded once (__hadd); FP8
  adds in half, converted back saturating (__NV_SATFINITE: beyond max, Inf too, -> +-max).
- ncclAvg (FuncPreMulSum): each input times float(1.0/N) in the dtype (FP8: e4m3's 2**-10 is 0).
- Ring (src/device/all_reduce.h): N chunks of ceil(count/N) aligned to 16 bytes, chunk c summed by
  ranks c+1, c+2, ..., c (mod N), rounded each add. Tree: a chain in each node, the nodes in the
  double binary tree (src/graph/trees.cc), half the elements on each of its two trees.
- torch's compress hooks (default_hooks.py): cast, divide in the dtype, SUM in it, back to float32.
NumPy's and ml_dtypes' casts round to nearest even as CUDA's do, and a 16-bit sum taken in float32
and rounded once is the exactly rounded one (24 >= 2p + 1 bits).
"""
import enum
import functools
from typing import List, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

from . import codec, emulate, scaling
from ._layout import BLOCK
from .formats import FloatFormat


class Wire(enum.Enum):
    """The dtype the peer allreduces in."""
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT8_E4M3 = "float8_e4m3fn"  # ncclFloat8e4m3 = __nv_fp8_e4m3: OCP E4M3, no Inf, max 448
    FLOAT8_E5M2 = "float8_e5m2"    # ncclFloat8e5m2

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self is Wire.FLOAT16 else getattr(ml_dtypes, self.value))

    @property
    def is_fp8(self) -> bool:
        return self.dtype.itemsize == 1

    @property
    def max(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def fmt(self) -> FloatFormat:
        """The hvd_aps format on the same grid (FP8 only)."""
        return FloatFormat.parse({Wire.FLOAT8_E4M3: "e4m3fn", Wire.FLOAT8_E5M2: "e5m2"}[self])


class Op(enum.Enum):
    SUM = "sum"
    AVG = "avg"  # ncclAvg


def cast(x: np.ndarray, wire: Wire) -> np.ndarray:
    """x (float16/32/64) held in `wire`, nearest-even; FP8 saturating (satfinite)."""
    x = np.asarray(x)
    if wire.is_fp8 and x.dtype == np.float16:
        return _fp8_tables(wire)[1][x.view(np.uint16)].view(wire.dtype)
    if wire.is_fp8 and not np.abs(x).max(initial=0) <= wire.max:
        x = np.clip(x, -wire.max, wire.max)  # beyond max, Inf too, -> +-max; NaN stays NaN
    return x.astype(wire.dtype)


@functools.lru_cache(maxsize=None)
def _fp8_tables(wire: Wire) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each FP8 code's float32 value; the satfinite FP8 code of each half; FuncSum of codes a, b
    at [a << 8 | b]: the exact sum rounded to half (__hadd), then to FP8."""
    values = np.arange(256, dtype=np.uint8).view(wire.dtype).astype(np.float32)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN codes; half's overflow to Inf
        from_half = np.clip(halves, -wire.max, wire.max).astype(wire.dtype).view(np.uint8)
        exact = values.astype(np.float64)[:, None] + values.astype(np.float64)[None, :]
        return values, from_half, from_half[exact.astype(np.float16).view(np.uint16)].ravel()


def widen(held: np.ndarray, wire: Wire) -> np.ndarray:
    """Values held in `wire` as float32 (exact)."""
    if wire.is_fp8:
        return _fp8_tables(wire)[0][held.view(np.uint8)]
    if wire is Wire.BFLOAT16:
        return (held.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return held.astype(np.float32)


def add(a: np.ndarray, b: np.ndarray, wire: Wire) -> np.ndarray:
    """NCCL's FuncSum of two arrays held in `wire`, elementwise."""
    if wire.is_fp8:
        return _fp8_tables(wire)[2][(a.view(np.uint8).astype(np.uint16) << 8) | b.view(np.uint8)].view(wire.dtype)
    with np.errstate(over="ignore"):  # a sum beyond the dtype's max rounds to Inf, as on the device
        return (widen(a, wire) + widen(b, wire)).astype(wire.dtype)


def _inputs(arrays: Sequence[np.ndarray], wire: Wire, op: Op) -> np.ndarray:
    """(N, count): each rank's input in `wire`; for ncclAvg times the dtype's 1/N by __hmul
    (an exact float32 product rounded once; FP8: to half, then to FP8)."""
    x = np.asarray(arrays, np.float32).reshape(len(arrays), -1)  # no copy for an (N, ...) float32 array
    held = cast(x, wire)
    if op is Op.AVG:
        product = widen(held, wire) * widen(cast(np.float32(1.0 / len(x)), wire).reshape(1), wire)
        held = cast(product.astype(np.float16), wire) if wire.is_fp8 else product.astype(wire.dtype)
    return held


def _ring(held: np.ndarray, wire: Wire) -> np.ndarray:
    """The reduce-scatter's sums in NCCL's hop order (the all-gather only copies them). One loop:
    chunks of ceil(count/N) elements aligned to 16 bytes (all_reduce.h:38)."""
    (n, count), align, raw = held.shape, 16 // wire.dtype.itemsize, np.dtype(f"u{wire.dtype.itemsize}")
    size = -(-count // (n * align)) * align  # = alignUp(divUp(count, n), align)
    padded = np.zeros((n, n * size), raw)  # gathers on raw bits are fast
    padded[:, :count] = held.view(raw)
    chunks, c = padded.reshape(n, n, size), np.arange(n)  # (rank, chunk, element)
    acc = chunks[(c + 1) % n, c].view(wire.dtype)  # chunk c starts at rank c + 1 ...
    for hop in range(2, n + 1):  # ... and ends at rank c + n = c
        acc = add(acc, chunks[(c + hop) % n, c].view(wire.dtype), wire)
    return acc.reshape(-1)[:count]


def nccl_ring_allreduce(arrays: Sequence[np.ndarray], wire: Union[Wire, str],
                        op: Union[Op, str] = Op.SUM) -> np.ndarray:
    """NCCL's ring allreduce (sum or ncclAvg) of `arrays` in `wire`, as float32."""
    wire, op = Wire(wire), Op(op)
    return widen(_ring(_inputs(arrays, wire, op), wire), wire).reshape(np.shape(arrays[0]))


def _children(nodes: int, node: int, second: bool) -> Tuple[int, int]:
    """(down0, down1) of `node` in NCCL's binary tree, or in its twin (trees.cc:32-112)."""
    if second:  # mirrored for an even count of nodes, shifted by one for an odd
        to, back = ((lambda r: (r - 1) % nodes), (lambda r: (r + 1) % nodes)) if nodes % 2 else \
            ((lambda r: nodes - 1 - r), (lambda r: nodes - 1 - r))
        return tuple(-1 if d == -1 else back(d) for d in _children(nodes, to(node), False))
    bit = 1
    while bit < nodes and not bit & node:
        bit <<= 1
    if node == 0:
        return -1, (bit >> 1 if nodes > 1 else -1)
    low = bit >> 1
    d1 = node + low if low else -1
    while d1 >= nodes:  # trees.cc:59-62 as written
        d1 = node + low if low else -1
        low >>= 1
    return (node - (bit >> 1) if bit >> 1 else -1), d1


def tree_children(nranks: int, ranks_per_node: int, second: bool = False) -> List[List[int]]:
    """Each rank's children in the order it reduces them: the next rank of its node's chain, then
    the node-tree children its local rank takes (local 1: child 0, local 0: child 1)."""
    if nranks % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} must divide the {nranks} ranks")
    nodes, g = nranks // ranks_per_node, ranks_per_node
    takers = (0, 0) if g == 1 else (1, 0)  # TREE pattern with one rank a node (search.cc:1133)
    down = [[r + 1] if (r + 1) % g else [] for r in range(nranks)]
    for node in range(nodes):
        for d, local in zip(_children(nodes, node, second), takers):
            if d != -1:
                down[node * g + local].append(d * g)
    return down


def _tree(held: np.ndarray, wire: Wire, down: List[List[int]]) -> np.ndarray:
    """Reduce up the tree: each rank its own input, then its children's sums in order."""
    children = {c for d in down for c in d}
    root = next(r for r in range(len(down)) if r not in children)
    order, sums = [root], {}
    for r in order:  # parents before children ...
        order.extend(down[r])
    for r in reversed(order):  # ... so children before parents
        acc = held[r]
        for c in down[r]:
            acc = add(acc, sums.pop(c), wire)
        sums[r] = acc
    return sums[root]


def nccl_tree_allreduce(arrays: Sequence[np.ndarray], wire: Union[Wire, str], op: Union[Op, str] = Op.SUM,
                        ranks_per_node: int = 8) -> np.ndarray:
    """NCCL's double-tree allreduce, nodes of ranks_per_node ranks (fewer ranks: one node)."""
    wire, op = Wire(wire), Op(op)
    held = _inputs(arrays, wire, op)
    n, half, g = len(held), held.shape[1] // 2, min(ranks_per_node, len(held))
    out = np.concatenate([_tree(held[:, :half], wire, tree_children(n, g)),
                          _tree(held[:, half:], wire, tree_children(n, g, second=True))])
    return widen(out, wire).reshape(np.shape(arrays[0]))


def torch_hook_allreduce(arrays: Sequence[np.ndarray], wire: Union[Wire, str] = Wire.BFLOAT16) -> np.ndarray:
    """torch's bf16/fp16_compress_hook on NCCL's ring: cast, divide by N in the dtype (times the
    float32 reciprocal), sum, back to float32."""
    wire = Wire(wire)
    if wire.is_fp8:
        raise ValueError("torch's compress hooks exist for float16 and bfloat16 only")
    held = _inputs(arrays, wire, Op.SUM)
    held = (widen(held, wire) * (np.float32(1) / np.float32(len(held)))).astype(wire.dtype)
    return widen(_ring(held, wire), wire).reshape(np.shape(arrays[0]))


def scaled_fp8_allreduce(arrays: Sequence[np.ndarray], wire: Union[Wire, str] = Wire.FLOAT8_E4M3) -> np.ndarray:
    """FP8 scaled by APS's shared power of two (from the Max-allreduced max |g|, with the x N headroom of a
    sum held in the format: the ring rounds every partial sum to FP8), summed by NCCL's ring in FP8, unscaled
    and divided by N in float32: APS's scale without the exact sum."""
    wire = Wire(wire)
    shift = scaling.shift_for(max(codec.amax(a) for a in arrays), len(arrays), wire.fmt)
    total = widen(_ring(_inputs(np.ldexp(np.asarray(arrays, np.float32), shift), wire, Op.SUM), wire), wire)
    return (np.ldexp(total, -shift) / np.float32(len(arrays))).reshape(np.shape(arrays[0]))


def aps_allreduce(arrays: Sequence[np.ndarray], fmt: Union[FloatFormat, str]) -> np.ndarray:
    """hvd_aps's flat codes exchange of one tensor, any power-of-two N: emulate.allreduce (terms
    rounded at the agreed APS shift, summed in float32 in rank order), times N (exact), then what
    emulate.allreduce leaves out: the owner's re-encode of every BLOCK (2048) elements of the sum
    at the shift of its own max (hvd_aps/_stages.py reduce), divided by N. Bit for bit
    emulate.codes_allreduce's (tests/test_peers.py) without a thread per worker."""
    n, fmt = len(arrays), FloatFormat.parse(fmt)
    if n & (n - 1):
        raise ValueError(f"aps_allreduce takes a power-of-two number of workers, got {n}")
    total = (emulate.allreduce(arrays, fmt, scaling="aps", accumulate="fp32") * np.float32(n)).ravel()
    each = np.repeat(scaling.shifts_for(codec.amax_blocks(total, BLOCK), 1, fmt).astype(np.int32), BLOCK)
    sums = np.ldexp(codec.quantize(np.ldexp(total, each[:total.size]), fmt), -each[:total.size])
    return (sums.astype(np.float32) / np.float32(n)).reshape(np.shape(arrays[0]))
