"""Cases for the table kernels, shared by the CPU emulation's tests (tests/test_simt.py) and the
device's (tests/test_gpu.py): tables whose rows share packed bytes, inputs with every special
value, APS shifts near and far, and the statistics' sums in the kernel's own order."""
import contextlib
import dataclasses

import numpy as np

import hvd_aps
from hvd_aps import _layout, _tables
from hvd_aps._layout import Segment
from hvd_aps._tables import COUNT, SAMPLE_SUMS, SRC, Blocks

SIZES = [1, 31, 4095, 4097]  # ending mid-byte and mid-row; LARGE once a format
LARGE = (1 << 20) + 3
ROW = 2048  # rows of at most a re-encode block (hvd_aps._layout.BLOCK)


@dataclasses.dataclass(frozen=True)
class Table:
    """n elements in rows of 1..ROW elements, listed in shuffled order, their codes packed into a
    few streams one row after another (neighbours sharing bytes), each stream starting mid-byte
    behind a gap; `size` the bytes a message needs."""
    blocks: Blocks
    size: int

    @classmethod
    def of(cls, n: int, fmt, rng) -> "Table":
        cuts = np.unique(np.concatenate([[0, n], rng.integers(1, max(n, 2), max(1, n // 700))]))
        counts = np.concatenate([_parts(int(c), -(-int(c) // ROW)) for c in np.diff(cuts)])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        stream = np.minimum(rng.integers(0, 3, len(counts)).cumsum() // 2, 2)  # up to 3 streams, in order
        base, pos, at = np.zeros(len(counts), np.int64), np.zeros(len(counts), np.int64), 0
        for s in np.unique(stream):
            rows = np.flatnonzero(stream == s)
            first = int(rng.integers(1, 8))
            base[rows] = at + 3
            pos[rows] = first + np.concatenate([[0], np.cumsum(counts[rows])[:-1]])
            at += 3 + fmt.packed_size(first + int(counts[rows].sum())) + 1
        order = rng.permutation(len(counts))
        index = rng.integers(0, 1 << 40, len(counts))
        blocks = Blocks.of(starts[order], counts[order], base[order], pos[order], index[order], 0, 0)
        return cls(blocks, at + 2)


def _parts(n: int, k: int) -> list:
    """n cut into k near-equal parts."""
    return [n // k + (i < n % k) for i in range(k)]


def inputs(n: int, fmt, rng) -> np.ndarray:
    """float32 over every binade, the format's grid and its ties at shift 0, float32 subnormals,
    signed zeros, NaN and Inf."""
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * np.exp2(rng.uniform(-150, 129, n))).astype(np.float32)
    grid = hvd_aps.decode(np.arange(1 << fmt.bits, dtype=fmt.code_dtype), fmt).astype(np.float64)
    grid = grid[np.isfinite(grid)]
    ties = np.sort(grid)[:-1] + np.diff(np.sort(grid)) / 2
    pick = rng.random(n)
    x = np.where(pick < 0.3, rng.choice(grid, n), x)
    x = np.where((pick >= 0.3) & (pick < 0.5), rng.choice(ties, n), x).astype(np.float32)
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -3e-39, 3e38])
    at = rng.integers(0, n, min(n, 40))
    x[at] = rng.choice(specials, at.size)
    return x


def shifts_for(count: int, rng) -> np.ndarray:
    """Per row: mostly small APS shifts, some far enough to flush every code or overflow them all."""
    shifts = rng.integers(-6, 9, count)
    far = rng.random(count) < 0.1
    shifts[far] = rng.choice([-60, -30, 30, 60], far.sum())
    return shifts.astype(np.int32)


def same(got: np.ndarray, want: np.ndarray, nan: bool = False) -> bool:
    """Exactly want's bytes; nan: float32 where any NaN equals any NaN (a sum where NaNs meet: which
    one an add returns is the compiled operand order's, and a device's is its canonical NaN)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not nan:
        return got.tobytes() == want.tobytes()
    return bool(((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))).all())


def tree_sums(x, sent, blocks, first, step, limits, threads=256) -> np.ndarray:
    """hvd_table_stats' arithmetic in NumPy: per row, each thread's float64 sums over its samples in
    order, then the pairwise tree of the block's shared memory, in the kernel's order."""
    sums = np.zeros((blocks.count, SAMPLE_SUMS))
    for b, row in enumerate(blocks.rows):
        taken = np.arange(first[b], row[COUNT], step[b])
        v = x[row[SRC] + taken].astype(np.float64)
        s = sent[row[SRC] + taken].astype(np.float64)
        d = s - v
        columns = [np.ones_like(v), v != 0, s != 0, (v > limits[b]) | (v < -limits[b]), d * d, v * v]
        partial = np.zeros((SAMPLE_SUMS, threads))
        for k, column in enumerate(columns):
            for t in range(threads):
                for value in column[t::threads]:
                    partial[k, t] += value
        width = threads // 2
        while width:
            partial[:, :width] += partial[:, width:2 * width]
            width //= 2
        sums[b] = partial[:, 0]
    return sums


@contextlib.contextmanager
def device():
    """The counting CuPy stand-in installed (tests/counting_cupy.py: the kernels' own text on the
    CPU) and the package's CuPy engine as it imports against it."""
    import counting_cupy
    with counting_cupy.installed():
        from hvd_aps import _cupy_engine
        yield _cupy_engine


def plan(fmt, world=3, rank=1, count=2):
    segments = tuple(Segment(t, 0, n) for t, n in enumerate(SIZES))
    held = _tables.held(segments)
    layout = _layout.layout(segments, world)
    lane = tuple(range(len(segments)))
    return held, _tables.chunk_plans([lane], [fmt], [layout], [layout.chunk(count)], segments=segments,
                                     data_offsets=held.offsets, world=world, rank=rank, padded=True)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp2(rng.integers(-20, 5, n))).astype(np.float32)
