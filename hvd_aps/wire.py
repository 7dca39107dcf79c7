"""Codes on the wire: the framework-neutral stages of one bucket's exchange.

Horovod cannot sum codes, so a bucket of gradients is reduced like a ring allreduce would, with
two collectives that only move bytes:

1. metadata: one Max-allreduce of every tensor's max |g| (and the compressor's signature), so all
   ranks agree on each tensor's APS shift;
2. begin: each tensor is scaled and encoded into one flat code buffer, cut into one shard per rank
   and packed (formats under 8 bits: several codes a byte); `alltoall` sends shard r to rank r;
3. reduce_shard: rank r decodes the N copies of its shard and sums them in float32, then
   re-encodes the sum with a fresh APS exponent per tensor piece (the exponents travel with the
   codes); `allgather` gives every rank every reduced shard;
4. finish: decode, divide by N for an average, cut back into tensors.

Each rank sends about 2 (N-1)/N x (bits/8) bytes per element, as a ring allreduce of 1-byte
values would: 4x less than fp32, 8x for 4-bit formats. Every rank decodes the same gathered bytes
with the same arithmetic, so the result is identical everywhere. Tensors whose agreed max is not
finite are left out of the codes (`state.fallback`) and come back filled with NaN on every rank,
so a NaN/Inf anywhere shows everywhere (a GradScaler skips the step) at no extra collective.
hvd_aps.exchange drives these stages; the collectives between them are the caller's.
"""
import dataclasses
import sys

import numpy as np

from . import _arrays, codec, scaling

_SHIFT = np.dtype("<i2")  # re-encode exponents on the wire
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # shards are summed in float32: no x N headroom needed


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
    """Where each tensor and each shard lies in a bucket's flat buffer: the same on every rank."""
    sizes: list
    world: int

    def __post_init__(self):
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.shards = shard_starts(int(self.offsets[-1]), self.world)

    def pieces(self, shard):
        """(tensor index, start, stop) of every tensor part inside shard `shard`, flat coordinates."""
        lo, hi = self.shards[shard], self.shards[shard + 1]
        return [(t, max(lo, a), min(hi, b)) for t, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:]))
                if max(lo, a) < min(hi, b)]

    def shard_len(self, shard):
        return int(self.shards[shard + 1] - self.shards[shard])

    def message_len(self, fmt):
        """Bytes of every rank's reduced-shard message: the longest one's (its packed codes and an
        int16 exponent per piece), so every allgather is of equal sizes, as torch.distributed's
        all_gather needs. Padding costs each rank at most a byte or two and 2 bytes per tensor."""
        return max(codec.packed_size(self.shard_len(r), fmt) + _SHIFT.itemsize * len(self.pieces(r))
                   for r in range(self.world))


@dataclasses.dataclass
class State:
    """What one bucket's exchange carries from stage to stage."""
    plan: Plan
    shifts: np.ndarray
    sizes: list      # every tensor's element count
    included: list   # indices of the tensors that travel as codes
    fallback: list   # indices of the tensors with a NaN/Inf somewhere: NaN on every rank (see above)
    bytes_sent: int = 0


class CodesExchange:
    """The stages of a bucket's exchange for one rank; the caller runs the collectives between them.
    Buffers are kept per bucket `key` and reused every step: fresh pages of a large allocation
    cost more to fault in than the codec takes to fill them."""

    def __init__(self, compressor, world, rank):
        self.comp, self.fmt, self.world, self.rank = compressor, compressor.fmt, world, rank
        self._buffers, self._results = {}, {}
        self._corrected_by_key = {}  # error feedback: what metadata() formed, for begin() to encode

    def metadata(self, flats, key=0):
        """Vector to Max-allreduce: every tensor's max |g| (with error feedback: of the gradient
        plus last step's residual), its size (and minus it), the signature."""
        flats = self._corrected(flats, key)
        return self.comp.metadata([codec.amax(f) for f in flats], [f.size for f in flats])

    def begin(self, flats, agreed, key=0, labels=None):
        """-> (bytes to alltoall, bytes per destination rank, State). `labels` name the tensors
        in errors and stats."""
        labels = labels or [f"{key}[{i}]" for i in range(len(flats))]
        flats = self._corrected_by_key.pop(key, flats)  # the driver calls metadata() first
        amaxes = self.comp.agreed_amaxes(agreed, [f.size for f in flats], labels)
        finite = np.isfinite(amaxes)
        shifts = (scaling.shifts_for(np.where(finite, amaxes, 0), self.world, self.fmt, _FLOAT32_MAX)
                  if self.comp.config.scaling == "aps" else np.zeros(len(flats), np.int64))
        included = [i for i in range(len(flats)) if finite[i]]
        state = State(Plan([flats[i].size for i in included], self.world), shifts, [f.size for f in flats], included,
                      [i for i in range(len(flats)) if not finite[i]])
        xp = _arrays.array_module(flats[0]) if flats else np
        flat = self._buffer((key, "codes"), int(state.plan.offsets[-1]), self.fmt.code_dtype, xp)
        for k, i in enumerate(included):
            codes = flat[state.plan.offsets[k]:state.plan.offsets[k + 1]]
            self._encode(flats[i].ravel(), int(shifts[i]), codes)
            self.comp.record_codes(labels[i], flats[i], codes, int(shifts[i]))
            self._keep_residual(key, i, flats[i].ravel(), codes, int(shifts[i]))
        for i in state.fallback:
            self.comp.record_codes(labels[i], flats[i], None, 0)
            self._keep_residual(key, i, flats[i].ravel(), None, 0)
        parts = [codec.pack(flat[state.plan.shards[r]:state.plan.shards[r + 1]], self.fmt) for r in range(self.world)]
        splits = [int(p.size) for p in parts]
        state.bytes_sent = sum(splits) - splits[self.rank]
        return (flat if self.fmt.bits == 8 else xp.concatenate(parts)), splits, state

    def reduce_shard(self, received, state, key=0):
        """The N packed copies of this rank's shard -> its reduced, re-encoded shard (bytes to allgather)."""
        xp = _arrays.array_module(received)
        n = state.plan.shard_len(self.rank)
        size = codec.packed_size(n, self.fmt)
        if self.fmt.bits == 8:
            codes = received.reshape(self.world, n)
        else:
            codes = xp.stack([codec.unpack(received[r * size:(r + 1) * size], self.fmt, n) for r in range(self.world)])
        lo = int(state.plan.shards[self.rank])
        total = self._buffer((key, "sum"), n, np.float32, xp)
        fresh_codes = self._buffer((key, "fresh"), n, self.fmt.code_dtype, xp)
        fresh_shifts = []
        for t, a, b in state.plan.pieces(self.rank):
            part, tensor = total[a - lo:b - lo], state.included[t]  # a tensor has one piece per shard
            part.fill(0)
            codec.decode_sum(codes[:, a - lo:b - lo], self.fmt, int(state.shifts[tensor]), out=part)
            if self.comp.config.error_feedback:  # the shard owner's re-encode loses bits too
                part += self.comp.residual(f"{key}:owner", tensor, part)
            fresh = scaling.shift_for(codec.amax(part), 1, self.fmt) if self.comp.config.scaling == "aps" else 0
            self._encode(part, fresh, fresh_codes[a - lo:b - lo])
            self._keep_residual(f"{key}:owner", tensor, part, fresh_codes[a - lo:b - lo], fresh)
            fresh_shifts.append(fresh)
        shift_bytes = xp.asarray(np.array(fresh_shifts, _SHIFT).view(np.uint8))
        packed = codec.pack(fresh_codes, self.fmt)
        padding = xp.zeros(state.plan.message_len(self.fmt) - packed.size - shift_bytes.size, np.uint8)
        message = xp.concatenate([packed, shift_bytes, padding])
        state.bytes_sent += int(message.size) * (self.world - 1)
        self.comp.record_sent(state.bytes_sent)
        return message

    def finish(self, gathered, state, outs=None, key=0, average=False):
        """Every rank's reduced shard -> the summed (average=True: divided by N in float32)
        tensors, float32 and flat, written into `outs` (one array per tensor) or into result
        buffers of this bucket `key`; NaN-filled for the tensors in state.fallback."""
        xp = _arrays.array_module(gathered)
        offsets, stride = state.plan.offsets, state.plan.message_len(self.fmt)
        if outs is None:
            outs = [self._result_buffer((key, i), n, xp) for i, n in enumerate(state.sizes)]
        for i in state.fallback:
            outs[i].fill(np.nan)
        included = [outs[i] for i in state.included]
        for r in range(self.world):
            n, pieces, at = state.plan.shard_len(r), state.plan.pieces(r), r * stride
            size = codec.packed_size(n, self.fmt)
            codes = codec.unpack(gathered[at:at + size], self.fmt, n)
            shifts = _arrays.to_numpy(gathered[at + size:at + size + _SHIFT.itemsize * len(pieces)]).view(_SHIFT)
            lo = int(state.plan.shards[r])
            for (t, a, b), shift in zip(pieces, shifts):
                codec.decode(codes[a - lo:b - lo], self.fmt, int(shift), out=included[t][a - offsets[t]:b - offsets[t]])
        if average:
            for out in outs:
                out /= np.float32(self.world)
        return outs

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

    def _keep_residual(self, key, i, x, codes, shift):
        """Error feedback: what this rank's codes lost of x (x - decode(codes)), for the next
        exchange of bucket `key`; zero where x went out as NaN (codes None)."""
        if not self.comp.config.error_feedback:
            return
        residual = self.comp.residual(key, i, x)
        if codes is None:
            residual.fill(0)
            return
        codec.decode(codes, self.fmt, shift, out=residual)
        _arrays.array_module(x).subtract(x, residual, out=residual)

    def _encode(self, x, shift, out):
        cfg = self.comp.config
        return codec.encode(x, self.fmt, cfg.rounding, self.comp.next_seed(self.rank), cfg.saturate, shift, out=out)

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
