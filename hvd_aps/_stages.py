"""Codes on the wire: the framework-neutral stages of one bucket's exchange (no collectives here;
hvd_aps.exchange runs them with the framework's).

Horovod and torch.distributed cannot sum codes, so a bucket is reduced as a ring allreduce would
be, with collectives that only move bytes (hvd_aps._layout has the geometry):

1. metadata: every tensor's max |g| (and size, the configuration's signature, with hybrid
   precision each tensor's sampled narrow-format error, while tuning the last exchange's time)
   goes into one Max-allreduce, so every rank agrees on each tensor's format and APS shift;
2. begin (per chunk): each rank encodes its part of every owner's range, scaled by its tensor's
   shift, straight into that owner's place in the alltoall message (packed below 8 bits);
3. reduce: each owner sums the N copies of its range in float32 in rank order, in one pass over
   the received bytes, and re-encodes every block of BLOCK elements at its own exponent straight
   into the allgather message (the exponents follow the codes);
4. finish: every rank decodes every owner's range into the results, divided by N for an average.

Each rank sends about 2 (N-1)/N x (bits/8) bytes per element: 4x less than fp32, 8x for 4-bit
formats. Every rank decodes the same gathered bytes alike, so results are identical everywhere,
and the same whatever the chunking. Tensors whose agreed max is not finite are left out of the
codes (`Agreement.fallback`) and come back NaN on every rank, so a NaN/Inf anywhere shows
everywhere (a GradScaler skips the step) at no extra collective.
"""
import dataclasses
import threading
from typing import Optional

import numpy as np

from . import _arrays, _layout, _metadata, codec, scaling
from ._layout import BLOCK, Segment
from ._state import OWNER, SEND

_SHIFT = np.dtype("<i2")  # re-encode exponents on the wire
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # ranges are summed in float32: no x N headroom needed
HYBRID_SAMPLE = 4096  # elements per tensor the hybrid policy's error estimate looks at
# Buckets whose results are larger than this are decoded past the caches (codec.decode_row's
# stream): they would leave a typical last-level cache before the optimizer reads them anyway.
STREAM_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What is exchanged: tensors of `sizes` (`keys`: stable names, equal on every rank, for
    residuals and stochastic rounding; `labels` for stats and errors) of which this rank holds
    `segments` (whole tensors, or with two levels its local slice of them)."""
    name: str
    keys: tuple
    labels: tuple
    sizes: tuple
    segments: tuple

    @classmethod
    def whole(cls, name: str, keys, labels, sizes) -> "Bucket":
        return cls(name, tuple(keys), tuple(labels), tuple(sizes), tuple(Segment(t, 0, n) for t, n in enumerate(sizes)))


@dataclasses.dataclass
class Lane:
    """The segments of a bucket that travel in one format (hybrid precision: a narrow and a wide
    lane), their layout among the ranks and its chunks."""
    fmt: object
    index: list       # the bucket's segment index of each of the lane's segments
    layout: object    # _layout.Layout
    chunks: list      # per chunk, per owner: its flat range
    owned: dict       # lane segment -> (tensor start, size) of this rank's share of it


@dataclasses.dataclass
class Agreement:
    """What the metadata allreduce settled for one exchange of a bucket, alike on every rank."""
    bucket: Bucket
    data: list          # per segment: what is encoded (with error feedback: gradient + residual)
    outs: list          # per segment: where its results go
    shifts: np.ndarray  # per tensor, for the format it travels in
    fallback: list      # segments of tensors with a NaN/Inf somewhere: NaN on every rank
    lanes: list
    count: int          # chunks
    divisor: float      # N for an average, 1 for a sum
    seeds: dict         # tensor -> stochastic rounding seed of this rank's encode
    encoded: list       # per segment: elements encoded so far (stats are recorded when all are)
    padded: bool        # every owner's reduced message padded to the longest
    lanes_of: tuple     # per tensor: its lane, -1 in the fallback (alike on every rank)
    stats: dict = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0
    lock: object = dataclasses.field(default_factory=threading.Lock)  # graph stages may run at once

    @property
    def stream(self) -> bool:
        return 4 * sum(self.bucket.sizes) >= STREAM_BYTES


def formats_and_shifts(config, amaxes: np.ndarray, errors: np.ndarray, world: int) -> tuple:
    """The agreed max |g| and hybrid errors of every tensor (or block) -> (finite: sent as codes,
    wide: in the hybrid's wider format, shifts: APS's power of two for its format), alike on
    every rank: the bucket exchange and the reduce-scatter decide by this one rule."""
    finite = np.isfinite(amaxes)
    wide = (~(errors <= config.hybrid_threshold) if config.hybrid is not None
            else np.zeros(len(amaxes), bool)) & finite
    shifts = np.zeros(len(amaxes), np.int64)
    fmts = (config.fmt, config.hybrid)
    for fmt, chosen in zip(fmts, (~wide & finite, wide)):
        if config.scaling == "aps" and chosen.any():
            shifts[chosen] = scaling.shifts_for(amaxes[chosen], world, fmt, _FLOAT32_MAX)
    return finite, wide, shifts


def hybrid_error(config, x, amax: float, world: int, stride: int = 1) -> float:
    """Hybrid precision: the mean over every `stride`-th nonzero element of x of |q(x) - x| / |x|,
    q rounding onto the narrow format at the shift this rank's amax alone gives. Elementwise, not
    ||q(x) - x|| / ||x||: the norm hides the small entries a narrow format flushes, and an Adam
    step scales every entry to its own size."""
    if not np.isfinite(amax) or amax == 0:
        return 0.0
    xp = _xp(x)
    sample = x.ravel()[::stride].astype(np.float32)
    sample = sample[sample != 0]
    if not sample.size:
        return 0.0
    shift = scaling.shift_for(amax, world, config.fmt, _FLOAT32_MAX) if config.scaling == "aps" else 0
    error = xp.abs(codec.quantize(sample, config.fmt, shift=shift) - sample) / xp.abs(sample)
    return float(xp.minimum(error, 1).mean())


class CodesExchange:
    """The stages of a bucket's exchange for one rank of the codes group (`world` ranks; with two
    levels, one per host). Collaborators: the frozen config, the ExchangeState (residuals, step
    counts, schedule, buffers) and the StatsRecorder."""

    def __init__(self, config, state, stats, world: int, rank: int, global_rank: int):
        self.config, self.state, self.stats = config, state, stats
        self.world, self.rank, self.global_rank = world, rank, global_rank
        self.fmts = [config.fmt] + ([config.hybrid] if config.hybrid is not None else [])

    # 1. metadata ----------------------------------------------------------------------------------
    def metadata(self, bucket: Bucket, data: list) -> tuple:
        """(vector to Max-allreduce, what begin() will encode): every tensor's max |g| (with error
        feedback of gradient + residual) over this rank's segments, sizes, hybrid errors, timing."""
        data = self._corrected(bucket, data)
        count = len(bucket.sizes)
        amaxes, errors = np.zeros(count), np.zeros(count)
        for seg, x in zip(bucket.segments, data):
            peak = codec.amax(x)
            amaxes[seg.tensor] = max(amaxes[seg.tensor], peak)
            if self.config.hybrid is not None:
                errors[seg.tensor] = max(errors[seg.tensor], self._sampled_error(x, peak))
        vector = _metadata.vector(self.config, amaxes, bucket.sizes, errors if self.config.hybrid is not None else (),
                                  self.state.schedule.entries(bucket.name), self.state.resumed_world)
        return vector, data

    # 2. agreement ---------------------------------------------------------------------------------
    def agree(self, bucket: Bucket, agreed, data: list, outs, divisor: float, xp, candidate: int,
              padded: bool = True, chunked: Optional[int] = None) -> Agreement:
        """The metadata allreduce's result -> the exchange's Agreement: every tensor's format and
        shift, the lanes and their chunks for `candidate` (chunk bytes), the result arrays
        (`outs`, else reused buffers), NaN-filled already for the tensors in the fallback.
        padded: the allgather needs messages of equal sizes. chunked: the elements the chunk count
        is cut from, where other groups must cut as many (default: the finite ones held here)."""
        amaxes, errors = self.check(bucket, agreed)
        finite, wide, shifts = formats_and_shifts(self.config, amaxes, errors, self.world)
        if outs is None:
            outs = [self.state.buffers.result((bucket.name, k), seg.size, xp) for k, seg in enumerate(bucket.segments)]
        fallback = [k for k, seg in enumerate(bucket.segments) if not finite[seg.tensor]]
        for k in fallback:
            outs[k].fill(np.nan)
        total = sum(seg.size for seg in bucket.segments if finite[seg.tensor]) if chunked is None else chunked
        count = max(1, -(-total // (candidate // 4))) if candidate > 0 else 1
        lanes = [self._lane(fmt, bucket, [finite[s.tensor] and wide[s.tensor] == bool(n) for s in bucket.segments],
                            count) for n, fmt in enumerate(self.fmts)]
        seeds = {t: self.state.seed_for(self.global_rank, bucket.keys[t], SEND) for t in range(len(amaxes))
                 } if self.config.rounding == "stochastic" else {}
        lanes_of = tuple(int(w) if f else -1 for f, w in zip(finite, wide))
        return Agreement(bucket, data, outs, shifts, fallback, lanes, count, divisor, seeds,
                         [0] * len(bucket.segments), padded, lanes_of)

    def owned(self, a: Agreement) -> list:
        """(tensor, start, size) of every share this rank owns and re-encodes: where its owner
        residuals lie."""
        return [(a.bucket.segments[lane.index[k]].tensor, start, size)
                for lane in a.lanes for k, (start, size) in lane.owned.items()]

    def check(self, bucket: Bucket, agreed) -> tuple:
        """The metadata allreduce's result checked (every rank configured alike, with the same
        tensors) -> (amaxes, errors); the schedule's timing entries recorded."""
        amaxes, errors, timing = _metadata.read(self.config, agreed, bucket.sizes, bucket.labels, self.world)
        self.state.ran_on(self.world)
        self.state.schedule.agreed(bucket.name, timing)
        return amaxes, errors

    def _lane(self, fmt, bucket, chosen, count) -> Lane:
        index = [k for k, c in enumerate(chosen) if c]
        layout = _layout.layout(tuple(bucket.segments[k] for k in index), self.world)
        mine = layout.pieces(int(layout.shards[self.rank]), int(layout.shards[self.rank + 1]))
        return Lane(fmt, index, layout, layout.chunk(count), {p.segment: (p.start, p.hi - p.lo) for p in mine})

    # 3. begin: encode -----------------------------------------------------------------------------
    def begin(self, a: Agreement, chunk: int) -> tuple:
        """Encode chunk `chunk` -> (bytes to alltoall, bytes per destination rank)."""
        if chunk == 0:
            self._leave_out(a)
        sizes = [codec.packed_size(hi - lo, lane.fmt) for r in range(self.world) for lane in a.lanes
                 for lo, hi in [lane.chunks[chunk][r]]]
        xp = _arrays.array_module(a.outs[0]) if a.outs else np
        message = self.state.buffers.get((a.bucket.name, "send", chunk), sum(sizes), np.uint8, xp)
        at = np.cumsum([0] + sizes)
        for r in range(self.world):
            for n, lane in enumerate(a.lanes):
                part = r * len(a.lanes) + n
                lo, hi = lane.chunks[chunk][r]
                row = _fresh_row(message[at[part]:at[part + 1]], hi - lo, lane.fmt)
                for p in lane.layout.pieces(lo, hi):
                    self._encode_piece(a, lane, p, row, p.lo - lo)
        splits = [int(at[(r + 1) * len(a.lanes)] - at[r * len(a.lanes)]) for r in range(self.world)]
        with a.lock:
            a.bytes_sent += sum(splits) - splits[self.rank]
        return message, splits

    def _encode_piece(self, a: Agreement, lane: Lane, p, row, pos: int) -> None:
        k = lane.index[p.segment]
        seg, x = a.bucket.segments[k], a.data[lane.index[p.segment]]
        piece = x[p.start - seg.start:p.start - seg.start + p.hi - p.lo]
        shift = int(a.shifts[p.tensor])
        self._encode(piece, row, pos, shift, lane.fmt, a.seeds.get(p.tensor), p.start)
        if self.config.error_feedback:
            residual = self.state.next_residual((a.bucket.keys[p.tensor], SEND, seg.start), seg.size, _xp(x))
            keep_residual(residual[p.start - seg.start:p.start - seg.start + piece.size], piece, row, pos, shift,
                          lane.fmt)
        self._record(a, k, piece, row, pos, shift, lane.fmt, p.start - seg.start)

    def _leave_out(self, a: Agreement) -> None:
        """The fallback's segments: stats say NaN/Inf, their residuals restart from zero."""
        for k in a.fallback:
            seg = a.bucket.segments[k]
            if self.config.error_feedback:
                self.state.next_residual((a.bucket.keys[seg.tensor], SEND, seg.start), seg.size, _xp(a.outs[k])).fill(0)
            self._record(a, k, a.data[k], None, 0, 0, self.fmts[0])

    # 4. reduce: sum and re-encode this rank's range ---------------------------------------------
    def reduce(self, a: Agreement, chunk: int, received) -> object:
        """The N packed copies of this rank's range of a chunk -> its reduced, re-encoded range
        (bytes to allgather, padded to every owner's longest message alike)."""
        xp = _arrays.array_module(received)
        sizes = [codec.packed_size(hi - lo, lane.fmt) for lane in a.lanes for lo, hi in [lane.chunks[chunk][self.rank]]]
        received = received.reshape(self.world, sum(sizes))
        lens = self._message_lens(a, chunk, self.rank)
        message = self.state.buffers.get((a.bucket.name, "reduced", chunk), sum(lens), np.uint8, xp)
        at = 0
        for n, (lane, size, start) in enumerate(zip(a.lanes, sizes, np.cumsum([0] + lens[:-1]))):
            self._reduce_lane(a, chunk, lane, n, received[:, at:at + size], message[start:start + lens[n]], xp)
            at += size
        with a.lock:
            a.bytes_sent += int(message.size) * (self.world - 1)
        return message

    def _reduce_lane(self, a, chunk, lane, n, rows, segment, xp) -> None:
        """One lane: each piece summed straight from the received bytes, every block re-encoded at
        its own exponent straight into the segment, the exponents after the codes, then padding."""
        lo, hi = lane.chunks[chunk][self.rank]
        size = codec.packed_size(hi - lo, lane.fmt)
        total = self.state.buffers.get((a.bucket.name, "sum", n, chunk), hi - lo, np.float32, xp)
        codes, fresh = _fresh_row(segment[:size], hi - lo, lane.fmt), []
        for p in lane.layout.pieces(lo, hi):
            part = total[p.lo - lo:p.hi - lo]
            _, peaks = codec.decode_sum_rows(rows, lane.fmt, p.lo - lo, p.hi - lo, int(a.shifts[p.tensor]), out=part,
                                             block=BLOCK)
            residual = self._owner_residual(a, lane, p, xp)
            if residual is not None:  # the owner's re-encode loses bits too
                part += residual[0]
                peaks = codec.amax_blocks(part, BLOCK)
            shifts = (scaling.shifts_for(peaks, 1, lane.fmt) if self.config.scaling == "aps"
                      else np.zeros(peaks.size, np.int64))
            seed = self.state.seed_for(-1, a.bucket.keys[p.tensor], OWNER) if self.config.rounding == "stochastic" else None
            self._encode(part, codes, p.lo - lo, shifts, lane.fmt, seed, p.start, block=BLOCK)
            if residual is not None:
                keep_residual(residual[1], part, codes, p.lo - lo, shifts, lane.fmt, block=BLOCK)
            fresh.append(shifts)
        end = size + _SHIFT.itemsize * lane.layout.blocks_in(lo, hi)
        if fresh:
            segment[size:end] = xp.asarray(np.concatenate(fresh).astype(_SHIFT).view(np.uint8))
        segment[end:] = 0  # the padding

    def _owner_residual(self, a, lane, p, xp):
        """Error feedback: (committed, next) residual of this rank's share of piece p's tensor, cut
        to the piece; None without feedback."""
        if not self.config.error_feedback:
            return None
        start, size = lane.owned[p.segment]
        key = (a.bucket.keys[p.tensor], OWNER, start)
        at = slice(p.start - start, p.start - start + p.hi - p.lo)
        return self.state.residual(key, size, xp)[at], self.state.next_residual(key, size, xp)[at]

    def _message_lens(self, a: Agreement, chunk: int, owner: int) -> list:
        """Per lane: the bytes of `owner`'s reduced message (packed codes and an exponent per
        block), or where the allgather needs equal sizes (torch.distributed's all_gather) the
        longest owner's, every message padded to it."""
        def length(lane, bounds):
            lo, hi = bounds
            return codec.packed_size(hi - lo, lane.fmt) + _SHIFT.itemsize * lane.layout.blocks_in(lo, hi)
        if a.padded:
            return [max(length(lane, bounds) for bounds in lane.chunks[chunk]) for lane in a.lanes]
        return [length(lane, lane.chunks[chunk][owner]) for lane in a.lanes]

    # 5. finish: decode every owner's range --------------------------------------------------------
    def finish(self, a: Agreement, chunk: int, gathered) -> None:
        """Every owner's reduced range of a chunk -> its slices of the results."""
        at = 0
        for r in range(self.world):
            lens = self._message_lens(a, chunk, r)
            for lane, start in zip(a.lanes, np.cumsum([0] + lens[:-1])):
                self._finish_range(a, lane, gathered[at + start:at + sum(lens)], lane.chunks[chunk][r])
            at += sum(lens)

    def _finish_range(self, a, lane, row, bounds) -> None:
        lo, hi = bounds
        size, blocks = codec.packed_size(hi - lo, lane.fmt), lane.layout.blocks_in(lo, hi)
        exponents = _arrays.to_numpy(row[size:size + _SHIFT.itemsize * blocks]).view(_SHIFT)
        first = 0
        for p in lane.layout.pieces(lo, hi):
            k = lane.index[p.segment]
            seg = a.bucket.segments[k]
            out = a.outs[k][p.start - seg.start:p.start - seg.start + p.hi - p.lo]
            codec.decode_row(row[:size], lane.fmt, p.lo - lo, p.hi - lo, exponents[first:first + p.blocks], out=out,
                             divisor=a.divisor, stream=a.stream, block=BLOCK)
            first += p.blocks

    def done(self, a: Agreement) -> list:
        """After the last chunk: the results (one per segment), the bytes counted, the tensors'
        exchange noted for the step's commit."""
        self.stats.record_sent(a.bytes_sent)
        self.state.exchanged(a.bucket.keys)
        return a.outs

    # helpers --------------------------------------------------------------------------------------
    def _encode(self, x, row, pos, shift, fmt, seed, index, block=None) -> None:
        cfg = self.config
        codec.encode_into(x, fmt, row, pos, cfg.rounding, seed, cfg.saturate, shift, index, block)

    def _record(self, a: Agreement, k: int, x, row, pos: int, shift: int, fmt, at: int = 0) -> None:
        """Stats of segment k's piece x (elements at.. of the segment; its codes at pos.. of packed
        `row`; None: it went out as NaN), recorded once the whole segment is in."""
        stats = self.stats.of_codes(x, row, pos, shift, fmt, a.bucket.segments[k].size, at)
        with a.lock:
            a.encoded[k] += x.size
            if stats is not None:
                a.stats[k] = a.stats[k] + stats if k in a.stats else stats
            if a.encoded[k] >= a.bucket.segments[k].size and k in a.stats:
                self.stats.record(a.bucket.labels[a.bucket.segments[k].tensor], a.stats.pop(k))

    def _sampled_error(self, x, amax: float) -> float:
        """Hybrid precision's estimate over a strided sample of x (about HYBRID_SAMPLE elements)."""
        return hybrid_error(self.config, x, amax, self.world, _arrays.sample_stride(x.size, HYBRID_SAMPLE))

    def _corrected(self, bucket: Bucket, data: list) -> list:
        """Error feedback: each segment plus its committed residual; the data as given otherwise."""
        if not self.config.error_feedback:
            return data
        return [corrected(self.state, (bucket.name, "corrected", k), (bucket.keys[seg.tensor], SEND, seg.start),
                          x.ravel()) for k, (seg, x) in enumerate(zip(bucket.segments, data))]


def _xp(x):
    return _arrays.array_module(x)


def _fresh_row(row, count: int, fmt):
    """`row`, about to take `count` packed codes, with the unused high bits of its last byte
    cleared (a reused buffer would send last step's bits there)."""
    if count * fmt.bits % 8:
        row[-1] = 0
    return row


def corrected(state, buffer_key: tuple, residual_key: tuple, x):
    """Error feedback: flat x plus the residual committed under `residual_key`, in the state's
    buffer `buffer_key`."""
    xp = _xp(x)
    total = state.buffers.get(buffer_key, x.size, np.float32, xp)
    xp.add(x, state.residual(residual_key, x.size, xp), out=total)
    return total


def keep_residual(residual, x, row, pos: int, shift, fmt, block=None) -> None:
    """Error feedback: what the codes at pos.. of packed `row` lost of x (x - their values), into
    `residual`, for the next exchange."""
    codec.decode_row(row, fmt, pos, pos + x.size, shift, out=residual, block=block)
    _xp(x).subtract(x, residual, out=residual)
