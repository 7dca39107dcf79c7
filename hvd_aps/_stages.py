"""Codes on the wire: the framework-neutral stages of one bucket's exchange, which hvd_aps.exchange
runs with collectives that only move bytes, as a ring allreduce would (hvd_aps._layout: geometry):

1. metadata: every tensor's max |g| (and size, signature, hybrid errors) in one Max-allreduce, so
   every rank agrees on each tensor's format and APS shift;
2. begin (per chunk): each rank encodes its part of every owner's range into the alltoall message;
3. reduce: each owner sums the N copies in float32 in rank order and re-encodes every block of
   BLOCK elements at its own exponent into the allgather message;
4. finish: every rank decodes every owner's range into the results, divided by N for an average.

The bucket is one flat float32 array; each stage is one engine call per lane over a table of its
blocks (hvd_aps._tables) kept in the Bucket, so its cost does not grow with the number of tensors.
Every rank decodes the same bytes, so results are identical everywhere, whatever the chunking;
tensors whose agreed max is not finite come back NaN on every rank (`Agreement.fallback`).
"""
import collections
import dataclasses
import functools
import threading
from typing import Optional

import numpy as np

from . import _arrays, _device, _layout, _metadata, _tables, codec, scaling
from ._layout import Segment
from ._residuals import OWNER, SEND
from ._schedule import Schedule
from ._state import ExchangeState
from ._stats import BucketStats, StatsRecorder
from .config import APSConfig, Rounding, Scaling

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # ranges are summed in float32: no x N headroom needed
HYBRID_SAMPLE = 4096  # elements per tensor the hybrid policy's error estimate looks at
# Buckets whose results are larger than this are decoded past the caches (the host engine's
# stream): they would leave a typical last-level cache before the optimizer reads them anyway.
STREAM_BYTES = 32 << 20
# Plans a bucket keeps: one per (lanes, chunk count, group); hybrid precision's choices and the
# schedule's trials move between a few
PLANS_KEPT = 8
BUCKETS_KEPT = 1024  # Bucket.whole's: every bucket a job exchanges, each step the same object
_cache_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What is exchanged: tensors of `sizes` (`keys`: stable names, equal on every rank, for
    residuals and stochastic rounding; `labels` for stats and errors) of which this rank holds
    `segments` (whole tensors, or with two levels its local slice of them), end to end in one
    flat array. `cache` keeps what is derived from the layout (tables, plans) between steps."""
    name: str
    keys: tuple
    labels: tuple
    sizes: tuple
    segments: tuple
    cache: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def whole(cls, name: str, keys, labels, sizes) -> "Bucket":
        """Every tensor whole (kept: the same arguments give the same Bucket, and its tables)."""
        return _whole(name, tuple(keys), tuple(labels), tuple(int(n) for n in sizes))

    def kept(self, key, make):
        """cache[key], made by make() the first time."""
        value = self.cache.get(key)
        if value is None:
            value = make()
            with _cache_lock:
                value = self.cache.setdefault(key, value)
        return value

    @property
    def offsets(self) -> np.ndarray:
        """Where each tensor starts in the flat bucket, and its end."""
        return self.kept("offsets", lambda: np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64))

    def split(self, flat) -> list:
        """The flat bucket's tensors, as views."""
        cuts = self.offsets
        return [flat[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]

    def held(self) -> "_tables.Held":
        return self.kept("held", lambda: _tables.held(self.segments))

    def part(self, segments: tuple) -> "Bucket":
        """This bucket's tensors of which this rank holds `segments` (kept)."""
        return self.kept(("part", segments), lambda: Bucket(self.name, self.keys, self.labels, self.sizes, segments))


@functools.lru_cache(maxsize=BUCKETS_KEPT)
def _whole(name, keys, labels, sizes) -> Bucket:
    return Bucket(name, keys, labels, sizes, tuple(Segment(t, 0, n) for t, n in enumerate(sizes)))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The tables of one exchange layout: per lane its format, held segments, Layout and this
    rank's shares (for owner residuals), per chunk its ChunkPlan, and the stats' sampling."""
    fmts: list
    lanes: list       # per lane: held segment indices
    layouts: list
    chunks: list      # per chunk: _tables.ChunkPlan
    shards: list      # per lane: this rank's shard (lo, hi)
    owned: list       # per lane: (tensor, start, size) of each share in the shard, in order
    owner_keys: list  # per lane: those shares' residual keys
    samples: list     # per chunk, per lane: (first, step) of every send block's stats sample
    carried: np.ndarray  # per held segment: packed bytes its codes take in the alltoall


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the metadata allreduce settled for one exchange of a bucket, alike on every rank."""
    bucket: Bucket
    plan: Plan
    shifts: np.ndarray  # per tensor, for the format it travels in
    shifts_here: object  # the same where the data lies (int32: what the engines read)
    fallback: np.ndarray  # held segments of tensors with a NaN/Inf somewhere: NaN on every rank
    count: int          # chunks
    divisor: float      # N for an average, 1 for a sum
    seeds: Optional[object]        # per tensor, where the data lies: stochastic rounding's seed of this rank's encode
    owner_seeds: Optional[object]  # per tensor, where the data lies: the shard owner's re-encode seed
    lanes_of: tuple     # per tensor: its lane, -1 in the fallback (alike on every rank)

    @property
    def stream(self) -> bool:
        return 4 * sum(self.bucket.sizes) >= STREAM_BYTES


class Exchange:
    """One exchange of a bucket in the codes group, as its stages see it: its Agreement, the
    arrays it reads and writes, and what its stages gather (stages of a graph may run at once:
    `lock`). hvd_aps.exchange.BucketExchange, the driver of the exchange, is one; CodesStages.agree
    starts it, every later stage reads and fills it, done() ends it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.end()

    def start(self, agreement: Agreement, source, results) -> None:
        self.end()
        self.agreement = agreement
        self.source = source    # flat: what is encoded (with error feedback: gradient + residual)
        self.results = results  # flat: where the results go

    def end(self) -> None:
        """Nothing under way (what the last exchange held let go)."""
        self.agreement: Optional[Agreement] = None
        self.source = self.results = None
        # error feedback: where this step's send residuals go (flat like source), and per lane
        # where its owner residuals go (this rank's shard), the committed ones read at reduce
        self.residual = None
        self.owner_residuals = []
        self.committed: Optional[list] = None
        # the stats: the sample sums (held segment of each block, per-block sums) per stage call,
        # and per lane each tensor's largest value sent, where the data lies
        self.sums: Optional[list] = None
        self.limits_here: Optional[list] = None
        self.bytes_sent = 0


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
        if config.scaling is Scaling.APS and chosen.any():
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
    shift = scaling.shift_for(amax, world, config.fmt, _FLOAT32_MAX) if config.scaling is Scaling.APS else 0
    error = xp.abs(codec.quantize(sample, config.fmt, shift=shift) - sample) / xp.abs(sample)
    return float(xp.minimum(error, 1).mean())


def limits(fmt, shifts):
    """The largest magnitude `fmt` carries at each exponent, as float32 (the stats' saturation),
    where the shifts lie."""
    xp = _xp(shifts)
    shifts = xp.asarray(shifts)
    return xp.ldexp(xp.full(shifts.shape, fmt.max, xp.float64), -shifts.astype(xp.int32)).astype(xp.float32)


def plan_for(bucket: Bucket, segment_lanes: np.ndarray, count: int, *, padded: bool, world: int, rank: int,
             fmts: tuple, sample: int) -> Plan:
    """The Plan of a bucket's exchange for these lanes (each held segment's lane, -1: left out),
    `count` chunks, on rank `rank` of `world`: made once and kept in the bucket (PLANS_KEPT)."""
    key = ("plan", segment_lanes.tobytes(), count, padded, world, rank, tuple(map(str, fmts)), sample)
    plans = bucket.kept("plans", collections.OrderedDict)
    plan = plans.get(key)
    if plan is None:
        plan = _make_plan(bucket, segment_lanes, count, padded=padded, world=world, rank=rank, fmts=fmts, sample=sample)
        with _cache_lock:
            plans[key] = plan
            while len(plans) > PLANS_KEPT:
                plans.popitem(last=False)
    return plan


def _make_plan(bucket: Bucket, segment_lanes: np.ndarray, count: int, *, padded: bool, world: int, rank: int,
               fmts: tuple, sample: int) -> Plan:
    held = bucket.held()
    lanes = [tuple(np.flatnonzero(segment_lanes == n).tolist()) for n in range(len(fmts))]
    layouts = [_layout.layout(tuple(bucket.segments[k] for k in lane), world) for lane in lanes]
    chunks = _tables.chunk_plans(lanes, list(fmts), layouts, [lay.chunk(count) for lay in layouts],
                                 segments=bucket.segments, data_offsets=held.offsets, world=world, rank=rank,
                                 padded=padded)
    shards, owned = [], []
    for lane, lay in zip(lanes, layouts):
        lo, hi = int(lay.shards[rank]), int(lay.shards[rank + 1])
        shards.append((lo, hi))
        owned.append([(bucket.segments[lane[p.segment]].tensor, p.start, p.hi - p.lo) for p in lay.pieces(lo, hi)])
    owner_keys = [tuple((bucket.keys[t], OWNER, start) for t, start, _ in shares) for shares in owned]
    seg_start = np.array([s.start for s in bucket.segments], np.int64)
    steps = np.array([_arrays.sample_stride(s.size, sample) for s in bucket.segments], np.int64)
    samples = [[_sampling(lc.send, seg_start, steps) for lc in chunk.lanes] for chunk in chunks]
    return Plan(list(fmts), lanes, layouts, chunks, shards, owned, owner_keys, samples,
                _carried(chunks, fmts, len(bucket.segments)))


def _sampling(send: "_tables.Blocks", seg_start: np.ndarray, steps: np.ndarray) -> tuple:
    """(first, step) per block: the stats sample every segment's elements 0, step, 2 step, ..."""
    step = steps[send.segment]
    return (-(send.rows[:, _tables.INDEX] - seg_start[send.segment])) % step, step


def _carried(chunks: list, fmts: tuple, segments: int) -> np.ndarray:
    """Per held segment, the packed bytes of its pieces in every destination's part."""
    carried = np.zeros(segments, np.int64)
    for chunk in chunks:
        for lc, fmt in zip(chunk.lanes, fmts):
            send = lc.send
            if not send.count:
                continue
            parts = np.unique(np.stack([send.rows[:, _tables.BASE], send.segment], axis=1), axis=0,
                              return_inverse=True)[1].ravel()
            counts = np.bincount(parts, weights=send.rows[:, _tables.COUNT]).astype(np.int64)
            owner_segment = np.zeros(len(counts), np.int64)
            owner_segment[parts] = send.segment
            np.add.at(carried, owner_segment, -(-counts * fmt.bits // 8))
    return carried


class CodesStages:
    """The stages of one bucket's Exchange for one rank of the codes group (`world` ranks; with
    two levels, one per host). Collaborators: the frozen config, the ExchangeState (residuals,
    step counts, schedule, buffers) and the StatsRecorder."""

    def __init__(self, config: APSConfig, state: ExchangeState, stats: StatsRecorder, world: int, rank: int,
                 seed_rank: int):
        self.config, self.state, self.stats = config, state, stats
        self.world, self.rank, self.seed_rank = world, rank, seed_rank
        self.fmts = [config.fmt] + ([config.hybrid] if config.hybrid is not None else [])

    @property
    def schedule(self) -> Schedule:
        """How each bucket runs (the state's): what the driver asks before and tells after an exchange."""
        return self.state.schedule

    # 1. metadata ----------------------------------------------------------------------------------
    def metadata(self, bucket: Bucket, data) -> tuple:
        """(vector to Max-allreduce, what begin() will encode): every tensor's max |g| (with error
        feedback of gradient + residual) over this rank's segments, sizes, hybrid errors, timing.
        `data`: the held segments end to end, one flat float32 array."""
        data = self._corrected(bucket, data)
        held = bucket.held()
        peaks = _tables.segment_max(codec.engine_for(data).table_amax(data, held.blocks), held)
        errors = np.zeros(len(bucket.sizes))
        if self.config.hybrid is not None:  # its choice is made on the host: the maxima read here
            host_peaks = _arrays.to_numpy(peaks)
            for k, (tensor, a, b) in enumerate(zip(held.tensor, held.offsets[:-1], held.offsets[1:])):
                errors[tensor] = self._sampled_error(data[a:b], host_peaks[k])
        vector = _metadata.vector(self.config, np.zeros(len(bucket.sizes)), bucket.sizes,
                                  errors if self.config.hybrid is not None else (),
                                  self.state.schedule.entries(bucket.name), self.state.resumed_world)
        return _metadata.with_amaxes(vector, held.tensor, peaks), data

    # 2. agreement ---------------------------------------------------------------------------------
    def agree(self, ex: Exchange, bucket: Bucket, agreed, data, out, *, divisor: float, xp, candidate: int,
              padded: bool = True, chunked: Optional[int] = None) -> None:
        """The metadata allreduce's result -> `ex` started under its Agreement: every tensor's format
        and shift, the plan of its lanes and chunks for `candidate` (chunk bytes), the result array
        (`out`, else a reused buffer), NaN-filled already for the tensors in the fallback.
        padded: the allgather needs messages of equal sizes. chunked: the elements the chunk count
        is cut from, where other groups must cut as many (default: the finite ones held here)."""
        amaxes, errors = self.check(bucket, agreed)
        finite, wide, shifts = formats_and_shifts(self.config, amaxes, errors, self.world)
        held = bucket.held()
        if out is None:
            out = self.state.buffers.result((bucket.name, "out"), int(held.offsets[-1]), xp)
        fallback = np.flatnonzero(~finite[held.tensor])
        for k in fallback:
            out[held.offsets[k]:held.offsets[k + 1]].fill(np.nan)
        sizes = np.diff(held.offsets)
        total = int(sizes[finite[held.tensor]].sum()) if chunked is None else chunked
        count = max(1, -(-total // (candidate // 4))) if candidate > 0 else 1
        lanes_of = np.where(finite, wide.astype(np.int64), -1)
        plan = self._plan(bucket, lanes_of[held.tensor], count, padded)
        stochastic = self.config.rounding is Rounding.STOCHASTIC
        agreement = Agreement(bucket, plan, shifts, _uploaded(shifts.astype(np.int32), xp), fallback, count, divisor,
                              self._seeds(bucket, self.seed_rank, SEND, xp) if stochastic else None,
                              self._seeds(bucket, -1, OWNER, xp) if stochastic else None, tuple(lanes_of.tolist()))
        ex.start(agreement, data, out)
        if self.config.error_feedback:
            self._feedback(ex, xp)
        if self.stats.enabled:
            ex.sums, ex.limits_here = [], [limits(fmt, agreement.shifts_here) for fmt in plan.fmts]

    def _seeds(self, bucket: Bucket, rank: int, side: str, xp):
        return _uploaded(np.array([self.state.seed_for(rank, key, side) for key in bucket.keys], np.uint64), xp)

    def _feedback(self, ex: Exchange, xp) -> None:
        """Error feedback: where this step's send residuals go (the fallback's restart from zero),
        and per lane where its owner residuals go."""
        a = ex.agreement
        keys, sizes = self._send_keys(a.bucket)
        ex.residual = self.state.residuals.next_flat((a.bucket.name, SEND), keys, sizes, xp)
        held = a.bucket.held()
        for k in a.fallback:
            ex.residual[held.offsets[k]:held.offsets[k + 1]] = 0
        for n, (keys, owned) in enumerate(zip(a.plan.owner_keys, a.plan.owned)):
            ex.owner_residuals.append(self.state.residuals.next_flat((a.bucket.name, OWNER, n), keys,
                                                                 [size for _, _, size in owned], xp))

    def _send_keys(self, bucket: Bucket) -> tuple:
        return bucket.kept("send keys", lambda: (tuple((bucket.keys[s.tensor], SEND, s.start) for s in bucket.segments),
                                                 [s.size for s in bucket.segments]))

    def owned(self, ex: Exchange) -> list:
        """(tensor, start, size) of every share this rank owns and re-encodes: where its owner
        residuals lie."""
        return [share for owned in ex.agreement.plan.owned for share in owned]

    def check(self, bucket: Bucket, agreed) -> tuple:
        """The metadata allreduce's result checked (every rank configured alike, with the same
        tensors) -> (amaxes, errors); the schedule's timing entries recorded."""
        amaxes, errors, timing = _metadata.read(self.config, agreed, bucket.sizes, bucket.labels, self.world)
        self.state.ran_on(self.world)
        self.state.schedule.agreed(bucket.name, timing)
        return amaxes, errors

    def _plan(self, bucket: Bucket, segment_lanes: np.ndarray, count: int, padded: bool) -> Plan:
        """The Plan for these lanes (each held segment's lane, -1: left out), kept in the bucket."""
        return plan_for(bucket, segment_lanes, count, padded=padded, world=self.world, rank=self.rank,
                        fmts=tuple(self.fmts), sample=self.stats.sample)

    # 3. begin: encode -----------------------------------------------------------------------------
    def begin(self, ex: Exchange, chunk: int) -> tuple:
        """Encode chunk `chunk` -> (bytes to alltoall, bytes per destination rank)."""
        a = ex.agreement
        plan = a.plan.chunks[chunk]
        xp = _xp(ex.results)
        message = self.state.buffers.get((a.bucket.name, "send", chunk), plan.send_bytes, np.uint8, xp)
        if plan.clear_send.size:  # a reused buffer would send last step's bits in a stream's unused high bits
            message[_device.on_device(plan.clear_send, message)] = 0
        engine = codec.engine_for(ex.source)
        for n, (lc, fmt) in enumerate(zip(plan.lanes, a.plan.fmts)):
            send = lc.send
            if not send.count:
                continue
            shifts = _device.take(a.shifts_here, send.tensor)
            engine.table_encode(ex.source, fmt, send, shifts, self.config.rounding,
                                None if a.seeds is None else _device.take(a.seeds, send.tensor), self.config.saturate,
                                message, ex.residual)
            if ex.sums is not None:
                first, step = (_device.on_device(c, message) for c in a.plan.samples[chunk][n])
                sums = engine.table_stats(ex.source, message, fmt, send, shifts, first, step,
                                          _device.take(ex.limits_here[n], send.tensor))
                with ex.lock:
                    ex.sums.append((send.segment, sums))
        with ex.lock:
            ex.bytes_sent += sum(plan.splits) - plan.splits[self.rank]
        return message, plan.splits

    # 4. reduce: sum and re-encode this rank's range ---------------------------------------------
    def reduce(self, ex: Exchange, chunk: int, received) -> object:
        """The N packed copies of this rank's range of a chunk -> its reduced, re-encoded range
        (bytes to allgather, padded to every owner's longest message alike)."""
        a = ex.agreement
        plan = a.plan.chunks[chunk]
        xp = _xp(received)
        rows = received.reshape(self.world, plan.row_bytes)
        message = self.state.buffers.get((a.bucket.name, "reduced", chunk), plan.reduced_bytes, np.uint8, xp)
        if plan.clear_reduced.size:  # unused high bits of the last code byte, and the padding
            message[_device.on_device(plan.clear_reduced, message)] = 0
        engine = codec.engine_for(received)
        for n, (lc, fmt) in enumerate(zip(plan.lanes, a.plan.fmts)):
            lo, hi = lc.range
            if hi == lo:
                continue
            total = self.state.buffers.get((a.bucket.name, "sum", n, chunk), hi - lo, np.float32, xp)
            peaks = engine.table_sum(rows, fmt, lc.reduce, _device.take(a.shifts_here, lc.reduce.tensor), total)
            residual = self._owner_residual(ex, n, lo, hi)
            if residual is not None:  # the owner's re-encode loses bits too
                total += residual[0]
                peaks = engine.table_amax(total, lc.reduce)
            # each block's exponent from its own max where the sums lie, written where the message
            # carries it: no host round trip
            exponents = message[lc.exponent_start:lc.exponent_start + _tables.EXPONENT.itemsize * peaks.size]
            if self.config.scaling is Scaling.APS:
                shifts = engine.table_shifts(peaks, scaling.limit_for(1, fmt), exponents)
            else:
                shifts = xp.zeros(peaks.size, np.int32)
                exponents.fill(0)
            engine.table_encode(total, fmt, lc.reencode, shifts, self.config.rounding,
                                None if a.owner_seeds is None else _device.take(a.owner_seeds, lc.reencode.tensor),
                                self.config.saturate, message, None if residual is None else residual[1])
        with ex.lock:
            ex.bytes_sent += int(message.size) * (self.world - 1)
        return message

    def _owner_residual(self, ex: Exchange, lane: int, lo: int, hi: int):
        """Error feedback: (committed, next) owner residual of flat range lo..hi of `lane`; None
        without feedback."""
        a = ex.agreement
        if not ex.owner_residuals:
            return None
        with ex.lock:  # read once the residuals of shares that changed owner have moved here (exchange.run)
            if ex.committed is None:
                xp = _xp(ex.owner_residuals[0])
                ex.committed = [self.state.residuals.committed_flat((a.bucket.name, OWNER, n), keys,
                                                                     [size for _, _, size in owned], xp)
                                 for n, (keys, owned) in enumerate(zip(a.plan.owner_keys, a.plan.owned))]
        start = a.plan.shards[lane][0]
        return ex.committed[lane][lo - start:hi - start], ex.owner_residuals[lane][lo - start:hi - start]

    # 5. finish: decode every owner's range --------------------------------------------------------
    def finish(self, ex: Exchange, chunk: int, gathered) -> None:
        """Every owner's reduced range of a chunk -> its place in the results."""
        a = ex.agreement
        engine = codec.engine_for(gathered)
        for lc, fmt in zip(a.plan.chunks[chunk].lanes, a.plan.fmts):
            if lc.finish.count:  # each block's exponent read from the message where it lies
                exponents = _device.take(gathered, lc.exponents).view(_tables.EXPONENT)
                engine.table_decode(gathered, fmt, lc.finish, exponents, ex.results, np.float32(a.divisor), a.stream)

    def done(self, ex: Exchange):
        """After the last chunk: the results (the flat `out`), the bytes recorded and the stats
        handed to the recorder (read a step later), the tensors' exchange noted for the step's
        commit; `ex` ended."""
        a = ex.agreement
        if ex.sums is not None:
            self.stats.record_bucket_later(a.bucket.name, [sums for _, sums in ex.sums],
                                           functools.partial(self._bucket_stats, a.bucket, a.plan, a.shifts, a.lanes_of,
                                                             [segment for segment, _ in ex.sums]))
        self.stats.record_sent(ex.bytes_sent)
        self.state.exchanged(a.bucket.keys)
        results = ex.results
        ex.end()
        return results

    def _bucket_stats(self, bucket: Bucket, plan: Plan, shifts: np.ndarray, lanes_of: tuple, segments: list,
                      block_sums: list) -> BucketStats:
        """The bucket's stats, one row per held segment: the sample scaled up by its stride, from
        every stage call's per-block sums (on the host by now) of the blocks of `segments`."""
        held = bucket.held()
        sums = _tables.segment_sums(segments, block_sums, len(held.tensor))
        sizes = np.diff(held.offsets)
        lanes = np.asarray(lanes_of)[held.tensor]
        finite = lanes >= 0
        steps = np.array([_arrays.sample_stride(int(n), self.stats.sample) for n in sizes], np.float64)
        fmts = [str(plan.fmts[lane]) if lane >= 0 else str(self.fmts[0]) for lane in lanes.tolist()]
        return BucketStats.of_sums([bucket.labels[t] for t in held.tensor.tolist()], fmts,
                                   np.where(finite, shifts[held.tensor], 0), sizes, steps, sums,
                                   np.where(finite, plan.carried, 0), finite)

    # helpers --------------------------------------------------------------------------------------
    def _sampled_error(self, x, amax: float) -> float:
        """Hybrid precision's estimate over a strided sample of x (about HYBRID_SAMPLE elements)."""
        return hybrid_error(self.config, x, amax, self.world, _arrays.sample_stride(x.size, HYBRID_SAMPLE))

    def _corrected(self, bucket: Bucket, data):
        """Error feedback: the data plus its committed residuals; the data as given otherwise."""
        if not self.config.error_feedback:
            return data
        keys, sizes = self._send_keys(bucket)
        xp = _xp(data)
        total = self.state.buffers.get((bucket.name, "corrected"), data.size, np.float32, xp)
        xp.add(data, self.state.residuals.committed_flat((bucket.name, SEND), keys, sizes, xp), out=total)
        return total


def _xp(x):
    return _arrays.array_module(x)


def _uploaded(host: np.ndarray, xp):
    """A host array where the data lies: itself, or a fresh copy on the device (an agreement's)."""
    return host if xp is np else xp.asarray(host)


def corrected(state, buffer_key: tuple, residual_key: tuple, x):
    """Error feedback: flat x plus the residual committed under `residual_key`, in the state's
    buffer `buffer_key`."""
    xp = _xp(x)
    total = state.buffers.get(buffer_key, x.size, np.float32, xp)
    xp.add(x, state.residuals.committed(residual_key, x.size, xp), out=total)
    return total
