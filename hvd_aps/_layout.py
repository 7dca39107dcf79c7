"""Where every element of a bucket goes in the codes exchange: pure geometry, the same on every rank.

A bucket's exchange works on *segments* (tensor, start, stop): whole tensors, or (two levels) the
part of each tensor in this local rank's slice, laid end to end into one flat range.

- Blocks: every tensor is cut into blocks of BLOCK elements from its first element, and a segment
  starts on one of its tensor's block boundaries, so a segment's blocks are its tensor's. Each
  block gets its own re-encode exponent: the numbers then depend on the tensors alone, never on
  how buckets are fused or cut into chunks.
- Shards: rank r owns the flat range shards[r] .. shards[r + 1] (cut on block boundaries, as
  evenly as they allow): it sums the ranks' codes there and re-encodes the sum.
- Chunks: each shard is cut into `count` parts on block boundaries; chunk c is the c-th part of
  every shard. A chunk's alltoall then sends every rank about 1/(N * count) of the bucket, and no
  element changes owner whatever the chunk count, so chunking is pure scheduling.
"""
import bisect
import dataclasses
import functools

import numpy as np

BLOCK = 2048  # elements per re-encode exponent: 2 bytes of exponent per 2048 codes (0.1% at 8 bits)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements start..stop of tensor `tensor` (its index in the bucket)."""
    tensor: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of segment `segment` in flat range lo..hi, and where it lies in the tensor."""
    segment: int
    tensor: int
    lo: int        # flat coordinates
    hi: int
    start: int     # tensor coordinates of lo
    blocks: int    # re-encode exponents it carries


class Layout:
    """The flat layout of a bucket's segments among `world` ranks."""

    def __init__(self, segments: tuple, world: int):
        self.segments, self.world = segments, world
        sizes = np.array([s.size for s in segments], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        starts = [o + np.arange(0, n, BLOCK) for o, n in zip(self.offsets[:-1], sizes) if n]
        self.boundaries = np.concatenate(starts + [[self.total]]).astype(np.int64)  # block starts, then the end
        self.shards = self.cut(0, self.total, world)
        # Every step asks for the same ranges' pieces: Python lists and a table of answers keep
        # the stages' per-range geometry off NumPy's per-call overhead.
        self._boundary_list, self._offset_list = self.boundaries.tolist(), self.offsets.tolist()
        self._pieces = {}

    def cut(self, lo: int, hi: int, parts: int) -> np.ndarray:
        """parts + 1 block boundaries from lo to hi, each the first at or after an even cut."""
        targets = lo + (hi - lo) * np.arange(parts + 1, dtype=np.int64) // max(parts, 1)
        return self.boundaries[np.searchsorted(self.boundaries, targets)]

    def chunk(self, count: int) -> list:
        """Per chunk, per owner rank: the flat range (lo, hi) of that owner's part of the chunk."""
        cuts = [self.cut(int(self.shards[r]), int(self.shards[r + 1]), count) for r in range(self.world)]
        return [[(int(c[k]), int(c[k + 1])) for c in cuts] for k in range(count)]

    def blocks_in(self, lo: int, hi: int) -> int:
        """Blocks that start in lo..hi (lo a block boundary): the exponents a range carries."""
        return bisect.bisect_left(self._boundary_list, hi) - bisect.bisect_left(self._boundary_list, lo)

    def pieces(self, lo: int, hi: int) -> tuple:
        """The segment parts in flat range lo..hi, in order."""
        if (lo, hi) not in self._pieces:
            self._pieces[(lo, hi)] = tuple(self._cut_pieces(lo, hi))
        return self._pieces[(lo, hi)]

    def _cut_pieces(self, lo: int, hi: int):
        offsets = self._offset_list
        for k in range(max(bisect.bisect_right(offsets, lo) - 1, 0), len(self.segments)):
            if offsets[k] >= hi:
                break
            a, b = max(lo, offsets[k]), min(hi, offsets[k + 1])
            if a < b:
                seg = self.segments[k]
                yield Piece(k, seg.tensor, a, b, seg.start + a - offsets[k], self.blocks_in(a, b))


@functools.lru_cache(maxsize=256)
def layout(segments: tuple, world: int) -> Layout:
    """The Layout of these segments (cached: a bucket's is the same every step)."""
    return Layout(segments, world)


def buckets(sizes: list, bucket_bytes: int, min_elements: int) -> tuple:
    """Tensors (by index) grouped for the exchange: in reverse order, the order backward produces
    gradients in, each bucket up to bucket_bytes of float32; tensors under min_elements apart (for
    a plain allreduce). The same sizes give the same buckets on every rank."""
    groups, size = [[]], 0
    for i in reversed(range(len(sizes))):
        if sizes[i] < min_elements:
            continue
        if groups[-1] and size + 4 * sizes[i] > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += 4 * sizes[i]
    return [g for g in groups if g], [i for i in range(len(sizes)) if sizes[i] < min_elements]


@functools.lru_cache(maxsize=256)
def slices(sizes: tuple, parts: int) -> tuple:
    """A bucket of tensors of `sizes` cut into `parts` slices on block boundaries (two levels:
    one slice per local rank) -> (the parts + 1 flat cuts, per slice its segments)."""
    whole = layout(tuple(Segment(t, 0, n) for t, n in enumerate(sizes)), 1)
    cuts = [int(c) for c in whole.cut(0, whole.total, parts)]
    return cuts, [tuple(Segment(p.tensor, p.start, p.start + p.hi - p.lo) for p in whole.pieces(a, b))
                  for a, b in zip(cuts[:-1], cuts[1:])]
