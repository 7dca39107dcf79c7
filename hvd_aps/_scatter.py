"""Codes in a reduce-scatter (FSDP2): the stages, without collectives (hvd_aps.exchange runs them).

The input is laid out (world, n): row r is what every rank contributes to rank r's shard. A
reduce-scatter knows no tensor boundaries (FSDP hands it one flat buffer a module), so each row is
cut into blocks of BLOCK elements, each with its own APS shift (and, hybrid, its own format).

1. metadata: the max |g| of every (row, block), hybrid errors, the signature;   Max-allreduce
2. agree: shifts and formats per block, each lane's blocks laid out per row (hvd_aps._tables);
3. begin: every row's blocks encoded into its owner's part of the message;        alltoall
4. reduce: this rank's row summed from the N copies in rank order in float32, one engine call per
   lane, divided by N for an average (one rounding).

A rank sends (N-1)/N of its codes once: half an allreduce's traffic and codec work. A block that
held NaN/Inf on any rank is left out of the codes and comes back NaN to its owner.
"""
import dataclasses
import functools

import numpy as np

from . import _arrays, _device, _metadata, _tables, codec
from ._layout import BLOCK
from ._stages import corrected, formats_and_shifts, hybrid_error, limits
from ._residuals import SEND
from ._stats import BucketStats
from .config import Rounding

LAYOUTS_KEPT = 64  # (world, n) and agreed lanes whose tables are kept: a model's few buffer sizes


@dataclasses.dataclass
class ScatterAgreement:
    name: str
    rows: object        # (world, n) float32: what is encoded (with error feedback: + residual)
    shifts: np.ndarray  # per (row, block)
    shifts_here: object  # the same where the rows lie (int32: what the engines read)
    send: list          # per lane: the Blocks every row's blocks of that lane are encoded by
    mine: list          # per lane: this rank's row's blocks, as its received part holds them
    lane_bytes: np.ndarray  # (world, lanes) packed bytes
    ends: np.ndarray        # the last byte of every part that has one: unused high bits cleared
    carried: np.ndarray     # per row: packed bytes of its codes, run by run
    last: list          # per row: (format, shift) of its last block sent, as the stats name it
    fallback: np.ndarray  # this rank's row: blocks NaN on every rank
    divisor: float
    seed: object


class ScatterStages:
    """The reduce-scatter's stages for one rank; collaborators as CodesStages'."""

    def __init__(self, config, state, stats, world: int, rank: int):
        self.config, self.state, self.stats, self.world, self.rank = config, state, stats, world, rank
        self.fmts = [config.fmt] + ([config.hybrid] if config.hybrid is not None else [])

    def _blocks(self, n: int) -> int:
        return -(-n // BLOCK)

    def _sizes(self, n: int) -> list:
        last = n - (self._blocks(n) - 1) * BLOCK
        return ([BLOCK] * (self._blocks(n) - 1) + [last]) * self.world if n else []

    def metadata(self, name: str, rows) -> tuple:
        """(vector to Max-allreduce, the rows to encode): per (row, block) max |g| and, with
        hybrid precision, the narrow format's sampled error at that block's own shift."""
        rows = self._corrected(name, rows)
        n = rows.shape[1]
        peaks = codec.engine_for(rows).table_amax(rows.reshape(-1), _row_blocks(self.world, n))  # where the rows lie
        errors = ()
        if self.config.hybrid is not None:  # its choice is made on the host: the maxima read here
            amaxes = _arrays.to_numpy(peaks)
            errors = [hybrid_error(self.config, rows[r, j * BLOCK:(j + 1) * BLOCK], amaxes[r * self._blocks(n) + j],
                                   self.world)
                      for r in range(self.world) for j in range(self._blocks(n))]
        vector = _metadata.vector(self.config, np.zeros(len(peaks)), self._sizes(n), errors,
                                  self.state.schedule.entries(name), self.state.resumed_world)
        return _metadata.with_amaxes(vector, _everyone(len(peaks)), peaks), rows

    def agree(self, name: str, agreed, rows, divisor: float) -> ScatterAgreement:
        n = rows.shape[1]
        sizes = self._sizes(n)
        amaxes, errors, timing = _metadata.read(self.config, agreed, sizes, _BlockLabels(name, len(sizes)),
                                                self.world)
        self.state.ran_on(self.world)
        self.state.schedule.agreed(name, timing)
        finite, wide, shifts = formats_and_shifts(self.config, amaxes, errors, self.world)
        per_row = self._blocks(n)
        counts = np.asarray(sizes, np.int64)
        lane = np.where(finite, wide.astype(np.int64), -1)
        row = np.repeat(np.arange(self.world), per_row)
        send, mine, lane_bytes, ends = _lane_tables(self.world, self.rank, n, tuple(self.fmts), lane.tobytes())
        seed = self.state.seed_for(self.rank, name, SEND) if self.config.rounding is Rounding.STOCHASTIC else None
        shifts_here = _arrays.array_module(rows).asarray(shifts.astype(np.int32))  # one upload, where the rows lie
        return ScatterAgreement(name, rows, shifts, shifts_here, send, mine, lane_bytes, ends,
                                self._carried(lane, shifts, counts, row),
                                self._last(lane, shifts, row), ~finite[self.rank * per_row:(self.rank + 1) * per_row],
                                divisor, seed)

    def _carried(self, lane, shifts, counts, row) -> np.ndarray:
        """Per row, the packed bytes of its runs (consecutive finite blocks of one lane and shift):
        what the stats call carried."""
        sent = np.flatnonzero(lane >= 0)
        if not sent.size:
            return np.zeros(self.world, np.int64)
        same = (np.diff(sent) == 1) & (np.diff(lane[sent]) == 0) & (np.diff(shifts[sent]) == 0) & (
            np.diff(row[sent]) == 0)
        first = np.flatnonzero(np.concatenate([[True], ~same]))
        elements = np.add.reduceat(counts[sent], first)
        bits = np.array([fmt.bits for fmt in self.fmts])[lane[sent][first]]
        return np.bincount(row[sent][first], weights=-(-elements * bits // 8), minlength=self.world).astype(np.int64)

    def _last(self, lane, shifts, row) -> list:
        """Per row, (format, shift) of its last block in the last lane that sent any: the fields
        a row's stats take from its last run."""
        out = []
        for r in range(self.world):
            last = None
            for k, fmt in enumerate(self.fmts):
                chosen = np.flatnonzero((lane == k) & (row == r))
                last = (str(fmt), int(shifts[chosen[-1]])) if chosen.size else last
            out.append(last)
        return out

    def begin(self, a: ScatterAgreement) -> tuple:
        """Every row's blocks encoded into its owner's part -> (bytes to alltoall, bytes per rank)."""
        xp, n = _arrays.array_module(a.rows), a.rows.shape[1]
        splits = [int(s) for s in a.lane_bytes.sum(axis=1)]
        message = self.state.buffers.get((a.name, "send"), sum(splits), np.uint8, xp)
        message[_device.on_device(a.ends, message)] = 0  # a reused buffer's unused high bits
        residual = (self.state.residuals.next((a.name, SEND, 0), a.rows.size, xp)
                    if self.config.error_feedback else None)
        if residual is not None:
            residual.fill(0)  # blocks left out (NaN/Inf) restart from zero
        flat, engine = a.rows.reshape(-1), codec.engine_for(a.rows)
        step = _arrays.sample_stride(n, self.stats.sample)  # a row's sample: its elements 0, step, 2 step, ...
        parts = []  # per lane that sent: (each block's row, its sample sums where the rows lie)
        for send, fmt in zip(a.send, self.fmts):
            if not send.count:
                continue
            shifts = _device.take(a.shifts_here, send.tensor)
            engine.table_encode(flat, fmt, send, shifts, self.config.rounding,
                                None if a.seed is None else xp.full(send.count, np.uint64(a.seed), np.uint64),
                                self.config.saturate, message, residual)
            if self.stats.enabled:
                parts.append((send.segment, engine.table_stats(flat, message, fmt, send, shifts,
                                                               _device.on_device(_sample_first(send, n, step), flat),
                                                               xp.full(send.count, step, np.int64),
                                                               limits(fmt, shifts))))
        if any(a.last[r] is not None for r in range(self.world)):  # a row all NaN/Inf records nothing
            self.stats.record_bucket_later(a.name, [sums for _, sums in parts],
                                           functools.partial(self._stats, a.name, a.last, a.send, a.carried, step,
                                                             [row for row, _ in parts]))
        self.stats.record_sent(sum(splits) - splits[self.rank])
        return message, splits

    def _stats(self, name: str, last: list, send: list, carried: np.ndarray, step: int, block_rows: list,
               block_sums: list) -> BucketStats:
        """Each row's stats where it sent any codes, from every lane's per-block sample sums (on
        the host by now; block_rows: each block's row). Made a step later: it holds what the
        stats need, not the agreement (whose rows are the reduce-scatter's whole input)."""
        sums = _tables.segment_sums(block_rows, block_sums, self.world)
        sent = [r for r in range(self.world) if last[r] is not None]
        elements = sum(np.bincount(table.segment, weights=table.rows[:, _tables.COUNT], minlength=self.world)
                       for table in send)[sent].astype(np.int64)
        return BucketStats.of_sums([f"{name}[{r}]" for r in sent], [last[r][0] for r in sent],
                                   [last[r][1] for r in sent], elements, np.full(len(sent), float(step)),
                                   sums[sent], carried[sent], np.ones(len(sent), bool))

    def reduce(self, a: ScatterAgreement, received, out) -> object:
        """The N received copies of this rank's row -> their float32 sum (divided by `divisor`) in `out`."""
        rows = received.reshape(self.world, int(a.lane_bytes[self.rank].sum()))
        out.fill(np.nan)  # what stays: the blocks left out
        engine = codec.engine_for(received)
        for mine, fmt in zip(a.mine, self.fmts):
            if mine.count:
                engine.table_sum(rows, fmt, mine, _device.take(a.shifts_here, mine.tensor), out)
        if a.divisor != 1:
            out /= np.float32(a.divisor)
        self.state.exchanged([a.name])
        return out

    def _corrected(self, name, rows):
        if not self.config.error_feedback:
            return rows
        return corrected(self.state, (name, "corrected"), (name, SEND, 0), rows.reshape(-1)).reshape(rows.shape)


def _row_starts(world: int, n: int) -> tuple:
    """(row, start in the row, elements) of every block of a (world, n) input, row by row: blocks
    are named by their place among every row's, (row, block)."""
    per_row = -(-n // BLOCK)
    start = np.tile(np.arange(per_row, dtype=np.int64) * BLOCK, world)
    return np.repeat(np.arange(world, dtype=np.int64), per_row), start, np.minimum(start + BLOCK, n) - start


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _row_blocks(world: int, n: int) -> _tables.Blocks:
    """Every (row, block) of a (world, n) input as one table: the metadata's maxima in one call,
    the same table every step (an engine keeps its device copy per table)."""
    row, start, counts = _row_starts(world, n)
    return _tables.Blocks.of(row * n + start, counts, 0, 0, row * n + start, np.arange(row.size), row)


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _lane_tables(world: int, rank: int, n: int, fmts: tuple, lanes: bytes) -> tuple:
    """(send, mine, lane_bytes, ends) for the agreed lanes (int64 bytes: each (row, block)'s lane,
    -1 for one left out): per lane, the table every row's blocks are encoded by and this rank's
    row's blocks as its received part holds them; the (world, lanes) packed bytes; the last byte
    of every part that has one. Kept per agreement, which steps repeat while the gradients'
    magnitudes and formats hold."""
    lane = np.frombuffer(lanes, np.int64)
    row, start, counts = _row_starts(world, n)
    block = np.arange(row.size)
    taken = [np.where(lane == k, counts, 0).reshape(world, -1) for k in range(len(fmts))]
    lane_bytes = np.array([[fmt.packed_size(int(t[r].sum())) for t, fmt in zip(taken, fmts)] for r in range(world)],
                          np.int64).reshape(world, len(fmts))
    at = np.concatenate([[0], np.cumsum(lane_bytes.ravel())])
    send, mine = [], []
    for k, t in enumerate(taken):
        pos = (np.cumsum(t, axis=1) - t).ravel()  # each block's place in its row's part of lane k
        sel = lane == k
        base = at[row * len(fmts) + k]
        send.append(_tables.Blocks.of(row[sel] * n + start[sel], counts[sel], base[sel], pos[sel],
                                      row[sel] * n + start[sel], block[sel], row[sel]))
        me = sel & (row == rank)
        mine.append(_tables.Blocks.of(start[me], counts[me], int(lane_bytes[rank, :k].sum()), pos[me], start[me],
                                      block[me], row[me]))
    lane_bytes.flags.writeable = False
    return send, mine, lane_bytes, np.cumsum(lane_bytes.ravel())[lane_bytes.ravel() > 0] - 1


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _sample_first(send: _tables.Blocks, n: int, step: int) -> np.ndarray:
    """Each block's first element in the stats' sample of its row (elements 0, step, 2 step, ...),
    kept per table (a device keeps its copy)."""
    return (-(send.rows[:, _tables.INDEX] - send.segment * n)) % step


@functools.lru_cache(maxsize=64)
def _everyone(count: int) -> np.ndarray:
    """0 .. count - 1, kept (a device keeps its copy): where each block's max goes in the vector."""
    return np.arange(count)


class _BlockLabels:
    """The labels _metadata.read names blocks by in its errors, made only when one is named."""

    def __init__(self, name: str, count: int):
        self.name, self.count = name, count

    def __getitem__(self, k: int) -> str:
        return f"{self.name}[block {k}]"

    def __len__(self) -> int:
        return self.count
