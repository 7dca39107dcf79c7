"""Codes on the wire: the framework-neutral stages of one bucket's exchange.

Horovod cannot sum codes, so a bucket of gradients is reduced like a ring allreduce would, with
two collectives that only move bytes:

1. metadata: one Max-allreduce of every tensor's max |g| (and the compressor's signature; with
   hybrid precision each tensor's sampled narrow-format error), so all ranks agree on each
   tensor's format and APS shift (`agree`);
2. the bucket, its tensors laid end to end, is cut into equal chunks (chunk_slices); per chunk:
   begin: the chunk's tensor slices are laid out in one flat code layout per format (a
   *lane*: the narrow format, and the wide one with hybrid precision), cut into one shard per
   rank; each slice is scaled and encoded straight into its places in the message, packed as
   it is written (formats under 8 bits: several codes a byte); `alltoall` sends shard r of
   every lane to rank r;
3. reduce_shard: rank r sums the N copies of its shard in float32 in one pass over the
   received bytes, then re-encodes the sum with a fresh APS exponent per slice piece straight
   into the message (the exponents travel with the codes); `allgather` gives every rank every
   reduced shard;
4. finish: decode straight from the gathered bytes into the results, divided by N for an
   average (large buckets' results written past the caches, STREAM_BYTES).

Each rank sends about 2 (N-1)/N x (bits/8) bytes per element, as a ring allreduce of 1-byte
values would: 4x less than fp32, 8x for 4-bit formats. Every rank decodes the same gathered bytes
with the same arithmetic, so the result is identical everywhere. Tensors whose agreed max is not
finite are left out of the codes (`Agreement.fallback`) and come back filled with NaN on every
rank, so a NaN/Inf anywhere shows everywhere (a GradScaler skips the step) at no extra collective.
hvd_aps.exchange drives these stages, chunks pipelined; the collectives between them are the
caller's.
"""
import dataclasses
import sys
import threading

import numpy as np

from . import _arrays, codec, scaling

_SHIFT = np.dtype("<i2")  # re-encode exponents on the wire
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # shards are summed in float32: no x N headroom needed
HYBRID_SAMPLE = 4096  # elements per tensor the hybrid policy's error estimate looks at
# Buckets whose results are larger than this are decoded past the caches (codec.decode_row's
# stream): they would leave a typical last-level cache before the optimizer reads them anyway.
STREAM_BYTES = 32 << 20


def buckets(sizes, bucket_bytes, min_elements):
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


def shard_starts(total, world):
    """Start of each of the `world` shards of a flat buffer, plus the end: the first total % world
    shards are one element longer."""
    base, extra = divmod(total, world)
    sizes = [base + (r < extra) for r in range(world)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclasses.dataclass
class Plan:
    """Where each slice and each shard lies in a lane's flat code buffer: the same on every rank."""
    sizes: list
    world: int

    def __post_init__(self):
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.shards = shard_starts(int(self.offsets[-1]), self.world)

    def pieces(self, shard):
        """(slice index, start, stop) of every slice part inside shard `shard`, flat coordinates."""
        lo, hi = self.shards[shard], self.shards[shard + 1]
        return [(t, max(lo, a), min(hi, b)) for t, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:]))
                if max(lo, a) < min(hi, b)]

    def spans(self, k):
        """(shard, start, stop) of slice k's part in every shard it reaches, flat coordinates."""
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        out = []
        for r in range(int(np.searchsorted(self.shards, a, side="right")) - 1, self.world):
            lo, hi = int(self.shards[r]), int(self.shards[r + 1])
            if lo >= b:
                break
            if max(lo, a) < min(hi, b):
                out.append((r, max(lo, a), min(hi, b)))
        return out

    def shard_len(self, shard):
        return int(self.shards[shard + 1] - self.shards[shard])

    def message_len(self, fmt):
        """Bytes of every rank's reduced-shard message: the longest one's (its packed codes and an
        int16 exponent per piece), so every allgather is of equal sizes, as torch.distributed's
        all_gather needs. Padding costs each rank at most a byte or two and 2 bytes per tensor."""
        return max(codec.packed_size(self.shard_len(r), fmt) + _SHIFT.itemsize * len(self.pieces(r))
                   for r in range(self.world))


def _fresh_row(row, count, fmt):
    """`row`, about to take `count` packed codes, with the unused high bits of its last byte
    cleared (a reused buffer would send last step's bits there)."""
    if count * fmt.bits % 8:
        row[-1] = 0
    return row


def chunk_slices(sizes, chunk_elements):
    """The bucket's tensors, laid end to end and cut into equal chunks of at most chunk_elements
    (0: one chunk): per chunk, the (tensor, start, stop) slices it holds, in tensor coordinates.
    The same sizes give the same chunks on every rank."""
    total = int(sum(sizes))
    bounds = shard_starts(total, max(1, -(-total // chunk_elements)) if chunk_elements else 1)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return [[(t, int(max(lo, a) - a), int(min(hi, b) - a)) for t, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))
             if max(lo, a) < min(hi, b)] for lo, hi in zip(bounds[:-1], bounds[1:])]


@dataclasses.dataclass
class Lane:
    """The tensor slices of a chunk that travel in one format, laid out in their own flat code
    buffer, each cut into one shard per rank."""
    fmt: object
    items: list  # (tensor, start, stop) slices, in bucket order
    plan: Plan

    def shard_bytes(self, shard):
        return codec.packed_size(self.plan.shard_len(shard), self.fmt)


@dataclasses.dataclass
class Agreement:
    """What the metadata allreduce settled for a whole bucket, on every rank alike."""
    key: object
    sizes: list        # every tensor's element count
    labels: list
    shifts: np.ndarray  # per tensor, for the format it travels in
    wide: np.ndarray    # per tensor: hybrid precision sends it in the wide format
    fallback: list      # tensors with a NaN/Inf somewhere: NaN on every rank (see above)
    chunks: list        # chunk_slices(sizes, ...)
    outs: list          # where the results go, one float32 flat per tensor
    average: bool
    corrected: list = None  # error feedback: gradient + residual, what begin() encodes
    stats: dict = dataclasses.field(default_factory=dict)  # per tensor, summed over its slices
    bytes_sent: int = 0
    lock: object = dataclasses.field(default_factory=threading.Lock)  # graph stages may run at once

    @property
    def stream(self):
        """Decode the results past the caches (STREAM_BYTES)."""
        return 4 * sum(self.sizes) >= STREAM_BYTES


@dataclasses.dataclass
class ChunkState:
    """What one chunk's exchange carries from stage to stage."""
    agreement: Agreement
    index: int
    lanes: list  # the narrow format's Lane, then (hybrid) the wide one's

    def message_lens(self):
        return [lane.plan.message_len(lane.fmt) for lane in self.lanes]


class CodesExchange:
    """The stages of a bucket's exchange for one rank; the caller runs the collectives between them.
    Buffers are kept per bucket `key` (and chunk) and reused every step: fresh pages of a large
    allocation cost more to fault in than the codec takes to fill them."""

    def __init__(self, compressor, world, rank):
        self.comp, self.fmt, self.world, self.rank = compressor, compressor.fmt, world, rank
        self.chunk_elements = compressor.config.chunk_bytes // 4
        self._buffers, self._results = {}, {}
        self._corrected_by_key = {}  # error feedback: what metadata() formed, for begin() to encode

    def chunk_count(self, sizes):
        return len(chunk_slices(sizes, self.chunk_elements))

    def metadata(self, flats, key=0):
        """Vector to Max-allreduce: every tensor's max |g| (with error feedback: of the gradient
        plus last step's residual), its size (and minus it), with hybrid precision the error the
        narrow format would make on a sample of it, and the signature."""
        flats = self._corrected(flats, key)
        amaxes = [codec.amax(f) for f in flats]
        errors = [self._sampled_error(f, a) for f, a in zip(flats, amaxes)] if self.comp.config.hybrid else ()
        return self.comp.metadata(amaxes, [f.size for f in flats], errors)

    def agree(self, agreed, sizes, key=0, labels=None, outs=None, average=False, xp=np):
        """The metadata allreduce's result -> the bucket's Agreement: every tensor's format and
        shift, its chunks, and the result arrays (`outs`, else this bucket's result buffers),
        NaN-filled already for the tensors in the fallback. average=True: results are divided
        by N in float32."""
        labels = labels or [f"{key}[{i}]" for i in range(len(sizes))]
        amaxes = self.comp.agreed_amaxes(agreed, sizes, labels)
        finite = np.isfinite(amaxes)
        wide = self.comp.goes_wide(agreed, len(sizes)) & finite
        shifts = np.zeros(len(sizes), np.int64)
        if self.comp.config.scaling == "aps":
            for fmt, chosen in ((self.fmt, ~wide), (self.comp.config.hybrid, wide)):
                chosen &= finite
                if chosen.any():
                    shifts[chosen] = scaling.shifts_for(amaxes[chosen], self.world, fmt, _FLOAT32_MAX)
        if outs is None:
            outs = [self._result_buffer((key, i), n, xp) for i, n in enumerate(sizes)]
        fallback = [i for i in range(len(sizes)) if not finite[i]]
        for i in fallback:
            outs[i].fill(np.nan)
        return Agreement(key, list(sizes), labels, shifts, wide, fallback,
                         chunk_slices([n if finite[i] else 0 for i, n in enumerate(sizes)], self.chunk_elements),
                         outs, average, self._corrected_by_key.pop(key, None))

    def begin(self, flats, agreement, chunk=0):
        """Encode chunk `chunk` of the bucket -> (bytes to alltoall, bytes per destination rank,
        ChunkState)."""
        a = agreement
        flats = a.corrected or flats  # the driver calls metadata() first
        if chunk == 0:
            for i in a.fallback:
                self._record(a, i, flats[i].ravel(), None, 0, 0, self.fmt, whole=True)
                if self.comp.config.error_feedback:
                    self.comp.residual(a.key, i, flats[i].ravel()).fill(0)
        fmts = [self.fmt] + ([self.comp.config.hybrid] if self.comp.config.hybrid else [])
        items = a.chunks[chunk]
        state = ChunkState(a, chunk, [Lane(f, [it for it in items if a.wide[it[0]] == n], None) for n, f in enumerate(fmts)])
        for lane in state.lanes:
            lane.plan = Plan([stop - start for _, start, stop in lane.items], self.world)
        # the message: shard r of every lane, for r = 0 .. N-1; each lane's codes are encoded
        # straight into their places in it
        sizes = [lane.shard_bytes(r) for r in range(self.world) for lane in state.lanes]
        xp = _arrays.array_module(flats[0]) if flats else np
        message = self._buffer((a.key, "send", chunk), sum(sizes), np.uint8, xp)
        at = np.cumsum([0] + sizes)
        lanes = len(state.lanes)
        for n, lane in enumerate(state.lanes):
            rows = [_fresh_row(message[at[r * lanes + n]:at[r * lanes + n + 1]], lane.plan.shard_len(r), lane.fmt)
                    for r in range(self.world)]
            self._encode_lane(lane, flats, a, rows)
        splits = [int(at[(r + 1) * lanes] - at[r * lanes]) for r in range(self.world)]
        with a.lock:
            a.bytes_sent += sum(splits) - splits[self.rank]
        return message, splits, state

    def _encode_lane(self, lane, flats, a, rows):
        """Encode a lane's slices straight into `rows`, the lane's packed shard in each rank's part
        of the message: one piece per shard a slice reaches, one seed per slice."""
        plan, feedback = lane.plan, self.comp.config.error_feedback
        for k, (i, start, stop) in enumerate(lane.items):
            x, shift, seed = flats[i].ravel()[start:stop], int(a.shifts[i]), self.comp.next_seed(self.rank)
            residual = self.comp.residual(a.key, i, flats[i].ravel())[start:stop] if feedback else None
            for r, p, q in plan.spans(k):
                at, pos = p - int(plan.offsets[k]), p - int(plan.shards[r])
                piece = x[at:at + q - p]
                self._encode(piece, rows[r], pos, shift, lane.fmt, seed, index=at)
                self._record(a, i, piece, rows[r], pos, shift, lane.fmt,
                             whole=stop == a.sizes[i] and q == plan.offsets[k + 1])
                self._keep_residual(None if residual is None else residual[at:at + q - p], piece, rows[r], pos, shift,
                                    lane.fmt)

    def reduce_shard(self, received, state):
        """The N packed copies of this rank's shard of a chunk -> its reduced, re-encoded shard
        (bytes to allgather)."""
        xp = _arrays.array_module(received)
        stride = sum(lane.shard_bytes(self.rank) for lane in state.lanes)  # what each rank sent here
        received = received.reshape(self.world, stride)
        lens = state.message_lens()
        message = self._buffer((state.agreement.key, "reduced", state.index), sum(lens), np.uint8, xp)
        at = 0
        for n, (lane, length, start) in enumerate(zip(state.lanes, lens, np.cumsum([0] + lens[:-1]))):
            size = lane.shard_bytes(self.rank)
            self._reduce_lane(received[:, at:at + size], lane, n, state, message[start:start + length], xp)
            at += size
        with state.agreement.lock:
            state.agreement.bytes_sent += int(message.size) * (self.world - 1)
        return message

    def _reduce_lane(self, received, lane, n, state, segment, xp):
        """One lane's N packed copies (rows) of this rank's shard -> into `segment` (padded to
        every rank's length alike): the re-encoded sums, packed, then an exponent per piece. Each
        piece is summed straight from the received bytes and encoded straight into the segment."""
        a, fmt, count = state.agreement, lane.fmt, lane.plan.shard_len(self.rank)
        lo, size = int(lane.plan.shards[self.rank]), lane.shard_bytes(self.rank)
        total = self._buffer((a.key, "sum", n, state.index), count, np.float32, xp)
        codes, fresh_shifts = _fresh_row(segment[:size], count, fmt), []
        owner = f"{a.key}:owner{state.index}"  # a slice has one piece per shard
        for t, p, q in lane.plan.pieces(self.rank):
            part, tensor = total[p - lo:q - lo], lane.items[t][0]
            _, peak = codec.decode_sum_rows(received, fmt, p - lo, q - lo, int(a.shifts[tensor]), out=part)
            residual = self.comp.residual(owner, tensor, part) if self.comp.config.error_feedback else None
            if residual is not None:  # the shard owner's re-encode loses bits too
                part += residual
                peak = codec.amax(part)
            fresh = scaling.shift_for(peak, 1, fmt) if self.comp.config.scaling == "aps" else 0
            self._encode(part, codes, p - lo, fresh, fmt, self.comp.next_seed(self.rank))
            self._keep_residual(residual, part, codes, p - lo, fresh, fmt)
            fresh_shifts.append(fresh)
        end = size + _SHIFT.itemsize * len(fresh_shifts)
        segment[size:end] = xp.asarray(np.array(fresh_shifts, _SHIFT).view(np.uint8))
        segment[end:] = 0  # the padding

    def finish(self, gathered, state):
        """Every rank's reduced shard of a chunk -> its slices of the results (the sums, divided
        by N where the agreement says average)."""
        lens = state.message_lens()
        gathered = gathered.reshape(self.world, sum(lens))
        for lane, at in zip(state.lanes, np.cumsum([0] + lens[:-1])):
            self._finish_lane(gathered[:, at:], lane, state.agreement)

    def _finish_lane(self, gathered, lane, a):
        """Decode a lane's segment of every rank's message (rows of `gathered`) into the results."""
        offsets = lane.plan.offsets
        for r in range(self.world):
            n, pieces = lane.plan.shard_len(r), lane.plan.pieces(r)
            size = codec.packed_size(n, lane.fmt)
            shifts = _arrays.to_numpy(gathered[r, size:size + _SHIFT.itemsize * len(pieces)]).view(_SHIFT)
            lo = int(lane.plan.shards[r])
            for (t, p, q), shift in zip(pieces, shifts):
                i, start, _ = lane.items[t]
                out = a.outs[i][start + p - offsets[t]:start + q - offsets[t]]
                codec.decode_row(gathered[r, :size], lane.fmt, p - lo, q - lo, int(shift), out=out,
                                 divisor=self.world if a.average else 1, stream=a.stream)

    def done(self, agreement):
        """After the last chunk: the results, and the bytes this rank sent counted."""
        self.comp.record_sent(agreement.bytes_sent)
        return agreement.outs

    def _record(self, a, i, x, row, pos, shift, fmt, whole):
        """Stats of tensor i's piece x (its codes at pos.. of packed `row`; None: it went out as
        NaN), recorded once its last piece is in (`whole`)."""
        stats = self.comp.measure_codes(x, row, pos, shift, fmt)
        if stats is None:
            return
        with a.lock:
            a.stats[i] = a.stats[i] + stats if i in a.stats else stats
            if whole:
                self.comp.record(a.labels[i], a.stats.pop(i))

    def _sampled_error(self, x, amax):
        """Hybrid precision: the mean over a strided sample of x's nonzero elements (about
        HYBRID_SAMPLE, _arrays.sample_stride) of
        |q(x) - x| / |x|, q rounding onto the narrow format at the shift this rank's amax alone
        gives. Elementwise, not ||q(x) - x|| / ||x||: the norm hides the small entries a narrow
        format flushes, and an Adam step scales every entry to its own size."""
        if not np.isfinite(amax) or amax == 0:
            return 0.0
        xp = _arrays.array_module(x)
        sample = x.ravel()[::_arrays.sample_stride(x.size, HYBRID_SAMPLE)].astype(np.float32)
        sample = sample[sample != 0]
        shift = scaling.shift_for(amax, self.world, self.fmt, _FLOAT32_MAX) if self.comp.config.scaling == "aps" else 0
        error = xp.abs(codec.quantize(sample, self.fmt, shift=shift) - sample) / xp.abs(sample)
        return float(xp.minimum(error, 1).mean()) if sample.size else 0.0

    def _corrected(self, flats, key):
        """Error feedback: each gradient plus its residual from the last exchange of bucket `key`,
        kept for begin() to encode; the gradients as given otherwise."""
        if not self.comp.config.error_feedback:
            return flats
        out = []
        for i, f in enumerate(flats):
            f = f.ravel()
            total = self._buffer((key, "corrected", i), f.size, np.float32, _arrays.array_module(f))
            _arrays.array_module(f).add(f, self.comp.residual(key, i, f), out=total)
            out.append(total)
        self._corrected_by_key[key] = out
        return out

    @staticmethod
    def _keep_residual(residual, x, row, pos, shift, fmt):
        """Error feedback: what the codes at pos.. of packed `row` lost of x (x - their values)
        into `residual`, for the next exchange; zero where x went out as NaN (row None).
        residual None: no feedback."""
        if residual is None:
            return
        if row is None:
            residual.fill(0)
            return
        codec.decode_row(row, fmt, pos, pos + x.size, shift, out=residual)
        _arrays.array_module(x).subtract(x, residual, out=residual)

    def _encode(self, x, row, pos, shift, fmt, seed, index=0):
        cfg = self.comp.config
        codec.encode_into(x, fmt, row, pos, cfg.rounding, seed, cfg.saturate, shift, index)

    def _result_buffer(self, name, n, xp):
        """Last step's result array for `name` where nothing outside holds it any more (the
        gradient it became was dropped), else a new one: writing into pages already mapped costs
        a third of faulting in fresh ones, and results are the largest arrays of the exchange."""
        buf = self._results.get(name)
        # references while free: the dict's, `buf`'s and getrefcount's argument
        if buf is None or buf.size != n or _arrays.array_module(buf) is not xp or sys.getrefcount(buf) > 3:
            buf = self._results[name] = xp.empty(n, xp.float32)
        return buf

    def _buffer(self, name, n, dtype, xp):
        buf = self._buffers.get(name)
        if buf is None or buf.size != n or buf.dtype != np.dtype(dtype) or _arrays.array_module(buf) is not xp:
            buf = self._buffers[name] = xp.empty(n, dtype)
        return buf
