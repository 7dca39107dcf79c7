"""Block tables: the segment tables one engine call per stage reads, made once per bucket layout.

A bucket's exchange works on one flat float32 array (the tensors, or with two levels the parts of
them in this local rank's slice, end to end). Every stage of a chunk is one engine call over a
table of *blocks*: runs of at most BLOCK elements of one tensor (its re-encode blocks), each row
saying where the block's elements lie in the float32 array read or written (SRC, COUNT), where
its packed codes lie in a message (BASE: the byte its stream starts at; POS: the code position
in that stream) and its first element's index for stochastic rounding's hash (INDEX: its place
in its tensor). Per block, besides: its tensor (whose shift and seed it takes) and its segment
(whose stats it counts in). The engines' table functions (codec's engine contract) loop over the
rows in compiled code or kernels, so a stage costs the same number of calls whatever the number
of tensors; the tables, made with NumPy from the layout, are kept per layout. The codec's public
functions (encode, decode, ...) call the same engine functions over a run's table (`run`).
"""
import dataclasses
import functools

import numpy as np

from . import _arrays, _device
from ._layout import Layout

SRC, COUNT, BASE, POS, INDEX = range(5)
COLUMNS = 5
# what table_stats sums per block (ops/host.c's HVD_STATS): samples, nonzero inputs, nonzero values
# sent, inputs beyond the format's limit, (sent - input)^2 and input^2
SAMPLE_SUMS = 6
EXPONENT = np.dtype("<i2")  # re-encode exponents on the wire, each block's after its codes
# Elements per row of a run's table: rows this short let the host engine's threads share even a
# one-block run (its sums, decodes and maxima cut between rows), and give a device one thread
# block per row, enough of them to fill it; per-row costs stay negligible at this length
RUN_ROW = 1 << 12
RUNS_KEPT = 64  # runs' tables kept (about 18 KB a table per million elements)


@dataclasses.dataclass(frozen=True, eq=False)
class Blocks:
    """Rows of blocks for one engine call (see the module docstring). Compared and hashed by
    identity: an engine may keep a copy of a table's rows (on a device) per table."""
    rows: np.ndarray     # (k, COLUMNS) int64, C-contiguous
    tensor: np.ndarray   # (k,) int64: the bucket's tensor index of each block
    segment: np.ndarray  # (k,) int64: the held segment of each block
    starts: np.ndarray   # (k + 1,) int64: elements before each block (threads cut by them)

    @classmethod
    def of(cls, src, count, base, pos, index, tensor, segment) -> "Blocks":
        count = np.asarray(count, np.int64)
        rows = np.ascontiguousarray(np.stack([np.asarray(c, np.int64) * np.ones_like(count)
                                              for c in (src, count, base, pos, index)], axis=1))
        rows.flags.writeable = False
        return cls(rows, np.asarray(tensor, np.int64), np.asarray(segment, np.int64),
                   np.concatenate([[0], np.cumsum(count)]).astype(np.int64))

    @property
    def count(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def in_stream_order(self) -> bool:
        """Whether the rows come stream by stream (BASE ascending) and, within one, by POS: then
        shares cut at codes that start a byte (cuts) leave no byte to two shares."""
        base, pos = self.rows[:, BASE], self.rows[:, POS]
        return bool(((base[1:] > base[:-1]) | ((base[1:] == base[:-1]) & (pos[1:] >= pos[:-1]))).all())

    @property
    def elements(self) -> int:
        return int(self.starts[-1])

    def with_base(self, base) -> "Blocks":
        """The same blocks, their streams starting at `base` (one value or one per block)."""
        rows = self.rows.copy()
        rows[:, BASE] = base
        rows.flags.writeable = False
        return Blocks(rows, self.tensor, self.segment, self.starts)

    def cuts(self, parts: int, period: int = 1) -> list:
        """`parts` shares of about equal elements, as ((b0, o0), (b1, o1)) block and element
        bounds (o1 == 0 with b1 == count: to the end). period > 1 (a packed stream's codes per
        whole bytes group): every cut at a code position that starts a byte, so no byte of a
        stream is shared between shares; 1: cuts on block boundaries only."""
        if self.count == 0:
            return []
        bounds = [(0, 0)]
        for k in range(1, parts):
            at = self._cut(self.elements * k // parts, period)
            if bounds[-1] < at < (self.count, 0):
                bounds.append(at)
        bounds.append((self.count, 0))
        return list(zip(bounds[:-1], bounds[1:]))

    def _cut(self, target: int, period: int) -> tuple:
        b = int(np.searchsorted(self.starts, target, side="right")) - 1
        if period == 1:
            return (b, 0) if target == self.starts[b] else (b + 1, 0) if b + 1 < self.count else (self.count, 0)
        while b < self.count:
            offset = target - int(self.starts[b]) if target > self.starts[b] else 0
            offset += -(int(self.rows[b, POS]) + offset) % period
            if offset < self.rows[b, COUNT]:
                return b, offset
            b, target = b + 1, 0
        return self.count, 0


@functools.lru_cache(maxsize=RUNS_KEPT)
def run(count: int, block: int, pos: int = 0, index: int = 0) -> Blocks:
    """The table of one run of `count` elements, as codec's public functions hand it to an
    engine: blocks of `block` elements (block k is tensor and segment k: it takes exponent k),
    each cut into rows of at most RUN_ROW; elements at SRC 0.., their codes at POS pos.. of one
    stream at BASE 0, their stochastic hash indices index... Kept per run, so a device's copy
    of a table (kept per table) is made once."""
    offsets = np.arange(0, min(block, count), RUN_ROW, dtype=np.int64)  # rows within a block
    starts = (np.arange(-(-count // block), dtype=np.int64)[:, None] * block + offsets).ravel()
    starts = starts[starts < count]
    owner = starts // block
    ends = np.minimum(np.minimum(starts + RUN_ROW, (owner + 1) * block), count)
    return Blocks.of(starts, ends - starts, 0, pos + starts, index + starts, owner, owner)


def blocks_of(layout: Layout, lo: int, hi: int) -> tuple:
    """The block starts in flat range lo..hi of a layout (lo, hi on block boundaries) and their
    ends: (starts, ends) as int64 arrays."""
    b = layout.boundaries
    first, last = np.searchsorted(b, [lo, hi])
    return b[first:last], b[first + 1:last + 1]


@dataclasses.dataclass(frozen=True)
class Held:
    """The blocks of a bucket's held segments (end to end in one flat array), and per segment its
    data offset, tensor, size and first block: what the metadata's maxima and the residuals use."""
    blocks: Blocks
    offsets: np.ndarray   # (segments + 1,) data offsets
    tensor: np.ndarray    # per segment: its tensor
    first: np.ndarray     # per segment: its first block (segments of no elements: -1)


def held(segments: tuple) -> Held:
    from ._layout import layout
    whole = layout(segments, 1)
    starts, ends = blocks_of(whole, 0, whole.total)
    seg = np.searchsorted(whole.offsets, starts, side="right") - 1
    seg_start = np.array([s.start for s in segments], np.int64)
    tensor = np.array([s.tensor for s in segments], np.int64)
    blocks = Blocks.of(starts, ends - starts, 0, 0, seg_start[seg] + starts - whole.offsets[seg], tensor[seg], seg)
    first = np.full(len(segments), -1, np.int64)
    first[seg[::-1]] = np.arange(len(seg))[::-1]
    return Held(blocks, whole.offsets, tensor, first)


def segment_sums(segments: list, block_sums: list, count: int) -> np.ndarray:
    """(count, SAMPLE_SUMS) float64: per segment, the sum of its blocks' sample sums, stage call
    after stage call (segments[k]: each block's segment in call k, block_sums[k] its sums)."""
    sums = np.zeros((count, SAMPLE_SUMS))
    for segment, part in zip(segments, block_sums):
        sums += np.stack([np.bincount(segment, weights=part[:, j], minlength=count)
                          for j in range(part.shape[1])], axis=1)
    return sums


def segment_max(peaks, held_: Held):
    """Per segment, the max of its blocks' peaks (0 for a segment of no elements), where the
    peaks lie (float64 on the host, float32 on a device)."""
    xp = _arrays.array_module(peaks)
    if xp is not np:  # maxima of |x| (+inf for NaN/Inf) order as their bits do: an integer max
        import cupyx
        out = xp.zeros(len(held_.tensor), xp.float32)
        if held_.blocks.count:
            cupyx.scatter_max(out.view(xp.uint32), _device.on_device(held_.blocks.segment, peaks),
                              peaks.view(xp.uint32))
        return out
    out = np.zeros(len(held_.tensor), np.float64)
    has = held_.first >= 0
    if has.any():
        out[has] = np.maximum.reduceat(np.asarray(peaks, np.float64), held_.first[has])
    return out


@dataclasses.dataclass(frozen=True)
class LaneChunk:
    """One lane's tables for one chunk: what this rank encodes for every owner (send), the sum
    and re-encode of its own range (reduce, reencode), what it decodes of every owner's range
    (finish, with the bytes its exponents lie at)."""
    send: Blocks
    reduce: Blocks
    reencode: Blocks
    finish: Blocks
    exponents: np.ndarray     # byte positions of the finish blocks' exponents in the gathered message, (2k,)
    range: tuple              # this rank's flat range of the lane (lo, hi)
    codes_bytes: int          # its packed codes' bytes ...
    exponent_start: int       # ... where its exponents start in the reduced message ...
    length: int               # ... and its part's length there (padded where the allgather needs it)


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    lanes: list           # per lane: its LaneChunk
    send_bytes: int       # the alltoall message
    splits: list          # bytes per destination rank
    row_bytes: int        # what each rank's part of the received message holds (this rank's range, every lane)
    reduced_bytes: int    # this rank's reduced message
    owner_bytes: list     # per owner: its reduced message's bytes in the gathered one
    clear_send: np.ndarray     # bytes of the send message whose unused high bits must be 0 (sub-byte streams)
    clear_reduced: np.ndarray  # the same in the reduced message, and its padding


def _part_sizes(lanes, fmts, chunk_ranges) -> np.ndarray:
    """(world, lanes) packed bytes of each destination's part of each lane."""
    return np.array([[fmt.packed_size(hi - lo) for (lo, hi), fmt in zip(ranges, fmts)]
                     for ranges in zip(*chunk_ranges)], np.int64).reshape(len(chunk_ranges[0]), len(lanes))


@dataclasses.dataclass(frozen=True)
class _Lane:
    """A lane's segments as arrays: their held index, tensor and start in the tensor."""
    held: np.ndarray
    tensor: np.ndarray
    start: np.ndarray

    @classmethod
    def of(cls, lane, segments: tuple) -> "_Lane":
        return cls(np.asarray(lane, np.int64), np.array([segments[i].tensor for i in lane], np.int64),
                   np.array([segments[i].start for i in lane], np.int64))


def _lane_blocks(lane: _Lane, layout: Layout, lo: int, hi: int, data_offsets: np.ndarray) -> tuple:
    """(block starts in lane flat coordinates, counts, data offsets, tensor indices, tensor
    coordinates, held segment) of the blocks in lane range lo..hi."""
    starts, ends = blocks_of(layout, lo, hi)
    k = np.searchsorted(layout.offsets, starts, side="right") - 1  # lane segment
    within = starts - layout.offsets[k]
    held_index = lane.held[k]
    return starts, ends - starts, data_offsets[held_index] + within, lane.tensor[k], lane.start[k] + within, held_index


def chunk_plans(lanes: list, fmts: list, layouts: list, chunks: list, *, segments: tuple, data_offsets: np.ndarray,
                world: int, rank: int, padded: bool) -> list:
    """Every chunk's ChunkPlan. lanes[n]: the held segment indices of lane n (in order), fmts[n]
    its format, layouts[n] its Layout over `world` ranks, chunks[n][c][r] the flat range of owner
    r's part of chunk c in lane n."""
    plans, arrays = [], [_Lane.of(lane, segments) for lane in lanes]
    for c in range(len(chunks[0])):
        ranges = [chunks[n][c] for n in range(len(lanes))]  # per lane, per owner
        parts = _part_sizes(lanes, fmts, ranges)  # (world, lanes)
        at = np.concatenate([[0], np.cumsum(parts.ravel())])
        reduced = [[fmt.packed_size(hi - lo) + EXPONENT.itemsize * layouts[n].blocks_in(lo, hi)
                    for n, (fmt, (lo, hi)) in enumerate(zip(fmts, (ranges[m][r] for m in range(len(lanes)))))]
                   for r in range(world)]
        lens = [max(reduced[r][n] for r in range(world)) for n in range(len(lanes))] if padded else None
        owner_lens = [lens if padded else reduced[r] for r in range(world)]
        owner_at = np.concatenate([[0], np.cumsum([sum(x) for x in owner_lens])])
        frame = _ChunkFrame(data_offsets, rank, parts, at, owner_lens, owner_at)
        lane_plans, clear_send, clear_reduced = [], [], []
        for n, (lane, fmt, layout) in enumerate(zip(arrays, fmts, layouts)):
            plan, cleared_sent, cleared_reduced = _lane_chunk(lane, fmt, layout, ranges[n], n, frame)
            lane_plans.append(plan)
            clear_send += cleared_sent
            clear_reduced.append(cleared_reduced)
        splits = [int(at[(r + 1) * len(lanes)] - at[r * len(lanes)]) for r in range(world)]
        plans.append(ChunkPlan(lane_plans, int(at[-1]), splits, int(parts[rank].sum()), int(sum(owner_lens[rank])),
                               [int(sum(x)) for x in owner_lens], np.array(clear_send, np.int64),
                               np.concatenate(clear_reduced).astype(np.int64) if clear_reduced else
                               np.zeros(0, np.int64)))
    return plans


@dataclasses.dataclass(frozen=True)
class _ChunkFrame:
    """Where one chunk's lanes go: the held data's offsets, this rank, and the bytes of every
    (rank, lane) part of the sent message and of every owner's reduced lanes."""
    data_offsets: np.ndarray
    rank: int
    parts: np.ndarray  # (world, lanes): the bytes of rank r's part of lane n
    at: np.ndarray     # part (r, n) starts at at[r * lanes + n] of the sent message
    owner_lens: list   # owner_lens[r][n]: the bytes of owner r's reduced lane n
    owner_at: np.ndarray  # owner r's reduced lanes start at owner_at[r] of the gathered message


def _lane_chunk(lane, fmt, layout, ranges, n: int, frame: _ChunkFrame) -> tuple:
    """Lane n's LaneChunk in this chunk (ranges[r]: owner r's flat range of it), with the sent
    bytes and the reduced bytes whose spare bits must be cleared (sub-byte formats)."""
    data_offsets, rank, parts, at, owner_lens, owner_at = (
        frame.data_offsets, frame.rank, frame.parts, frame.at, frame.owner_lens, frame.owner_at)
    lane_count, clear_send = parts.shape[1], []
    sub_byte = fmt.bits % 8 != 0
    send = []
    for r, (lo, hi) in enumerate(ranges):
        starts, counts, src, tensor, index, seg = _lane_blocks(lane, layout, lo, hi, data_offsets)
        base = int(at[r * lane_count + n])
        send.append((src, counts, np.full(len(starts), base), starts - lo, index, tensor, seg))
        if sub_byte and (hi - lo) * fmt.bits % 8:
            clear_send.append(base + int(parts[r, n]) - 1)
    send = Blocks.of(*(np.concatenate(col) for col in zip(*send)))
    lo, hi = ranges[rank]
    starts, counts, _, tensor, index, seg = _lane_blocks(lane, layout, lo, hi, data_offsets)
    row_at = int(parts[rank, :n].sum())  # this lane's part in each rank's received row
    reduce = Blocks.of(starts - lo, counts, row_at, starts - lo, index, tensor, seg)
    start = int(sum(owner_lens[rank][:n]))
    codes_bytes = fmt.packed_size(hi - lo)
    reencode = reduce.with_base(start)
    end = start + owner_lens[rank][n]
    clear_reduced = np.arange(start + codes_bytes - (1 if sub_byte and codes_bytes else 0), end)
    finish, exponents = [], []
    for r, (olo, ohi) in enumerate(ranges):
        starts, counts, src, tensor, index, seg = _lane_blocks(lane, layout, olo, ohi, data_offsets)
        base = int(owner_at[r]) + int(sum(owner_lens[r][:n]))
        finish.append((src, counts, np.full(len(starts), base), starts - olo, index, tensor, seg))
        first = base + fmt.packed_size(ohi - olo) + EXPONENT.itemsize * np.arange(len(starts))
        exponents.append(np.stack([first, first + 1], axis=1).ravel())
    finish = Blocks.of(*(np.concatenate(col) for col in zip(*finish)))
    return LaneChunk(send, reduce, reencode, finish, np.concatenate(exponents).astype(np.int64), (lo, hi), codes_bytes,
                     start + codes_bytes, owner_lens[rank][n]), clear_send, clear_reduced
