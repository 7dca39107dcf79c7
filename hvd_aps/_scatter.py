"""Codes in a reduce-scatter (FSDP2): the stages, without collectives (hvd_aps.exchange runs them).

The input is laid out (world, n): row r is what every rank contributes to rank r's shard. Every
row is cut into blocks of BLOCK elements, and block j of row r gets its own APS shift (and, with
hybrid precision, its own format) from one Max-allreduce of every rank's max |g| per block: a
reduce-scatter knows no tensor boundaries (FSDP hands it one flat buffer per module), and a shift
per block follows the gradients' magnitudes at least as closely as one per tensor would.

1. metadata: the max |g| of every (row, block), hybrid errors, the signature;   Max-allreduce
2. agree: shifts and formats per block; consecutive blocks of one format and shift form runs;
3. begin: row r's runs encoded straight into rank r's part of the message;      alltoall
4. reduce: this rank's row summed from the N received copies in rank order in float32, run by
   run in one pass over the packed bytes, divided by N for an average (one float32 rounding).
A rank sends (N-1)/N of its codes once: half an allreduce's traffic and codec work. A block that
held NaN/Inf on any rank is left out of the codes and comes back NaN to its owner.
"""
import dataclasses

import numpy as np

from . import _arrays, _metadata, codec
from ._layout import BLOCK
from ._stages import corrected, formats_and_shifts, hybrid_error, keep_residual
from ._state import SEND


@dataclasses.dataclass(frozen=True)
class Run:
    """Blocks of one row that travel alike: elements lo..hi of the row, in `fmt` at `shift`."""
    lane: int
    lo: int
    hi: int
    shift: int


@dataclasses.dataclass
class ScatterAgreement:
    name: str
    rows: object        # (world, n) float32: what is encoded (with error feedback: + residual)
    runs: list          # per row: its Runs, in order
    lane_bytes: list    # per row: per lane, packed bytes
    fallback: np.ndarray  # this rank's row: blocks NaN on every rank
    divisor: float
    seed: object


class ScatterExchange:
    """The reduce-scatter's stages for one rank; collaborators as CodesExchange's."""

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
        amaxes = np.concatenate([codec.amax_blocks(row, BLOCK) for row in rows]) if n else np.zeros(0)
        errors = ()
        if self.config.hybrid is not None:
            errors = [hybrid_error(self.config, rows[r, j * BLOCK:(j + 1) * BLOCK], amaxes[r * self._blocks(n) + j],
                                   self.world)
                      for r in range(self.world) for j in range(self._blocks(n))]
        return _metadata.vector(self.config, amaxes, self._sizes(n), errors, self.state.schedule.entries(name),
                                self.state.resumed_world), rows

    def agree(self, name: str, agreed, rows, divisor: float) -> ScatterAgreement:
        n = rows.shape[1]
        sizes = self._sizes(n)
        amaxes, errors, timing = _metadata.read(self.config, agreed, sizes,
                                                [f"{name}[block {k}]" for k in range(len(sizes))], self.world)
        self.state.ran_on(self.world)
        self.state.schedule.agreed(name, timing)
        finite, wide, shifts = formats_and_shifts(self.config, amaxes, errors, self.world)
        per_row = self._blocks(n)
        runs = [self._runs(n, finite[r * per_row:(r + 1) * per_row], wide[r * per_row:(r + 1) * per_row],
                           shifts[r * per_row:(r + 1) * per_row]) for r in range(self.world)]
        lane_bytes = [[codec.packed_size(sum(u.hi - u.lo for u in row if u.lane == k), fmt)
                       for k, fmt in enumerate(self.fmts)] for row in runs]
        seed = self.state.seed_for(self.rank, name, SEND) if self.config.rounding == "stochastic" else None
        return ScatterAgreement(name, rows, runs, lane_bytes, ~finite[self.rank * per_row:(self.rank + 1) * per_row],
                                divisor, seed)

    @staticmethod
    def _runs(n, finite, wide, shifts) -> list:
        runs = []
        for j in np.flatnonzero(finite):
            lo, hi, lane = int(j) * BLOCK, min(n, (int(j) + 1) * BLOCK), int(wide[j])
            last = runs[-1] if runs else None
            if last is not None and last.hi == lo and last.lane == lane and last.shift == shifts[j]:
                runs[-1] = Run(lane, last.lo, hi, last.shift)
            else:
                runs.append(Run(lane, lo, hi, int(shifts[j])))
        return runs

    def begin(self, a: ScatterAgreement) -> tuple:
        """Every row's runs encoded into its owner's part -> (bytes to alltoall, bytes per rank)."""
        xp, n = _arrays.array_module(a.rows), a.rows.shape[1]
        splits = [sum(lanes) for lanes in a.lane_bytes]
        message = self.state.buffers.get((a.name, "send"), sum(splits), np.uint8, xp)
        residual = (self.state.next_residual((a.name, SEND, 0), a.rows.size, xp).reshape(a.rows.shape)
                    if self.config.error_feedback else None)
        if residual is not None:
            residual.fill(0)  # blocks left out (NaN/Inf) restart from zero
        at = 0
        for r in range(self.world):
            stats = None
            for k, fmt in enumerate(self.fmts):
                segment = message[at:at + a.lane_bytes[r][k]]
                if segment.size:
                    segment[-1] = 0  # a reused buffer's unused high bits
                pos = 0
                for run in (u for u in a.runs[r] if u.lane == k):
                    x = a.rows[r, run.lo:run.hi]
                    codec.encode_into(x, fmt, segment, pos, self.config.rounding, a.seed, self.config.saturate,
                                      run.shift, r * n + run.lo)
                    if residual is not None:
                        keep_residual(residual[r, run.lo:run.hi], x, segment, pos, run.shift, fmt)
                    measured = self.stats.of_codes(x, segment, pos, run.shift, fmt, a.rows.shape[1], run.lo)
                    stats = measured if stats is None else stats + measured if measured else stats
                    pos += x.size
                at += a.lane_bytes[r][k]
            self.stats.record(f"{a.name}[{r}]", stats)
        self.stats.record_sent(sum(splits) - splits[self.rank])
        return message, splits

    def reduce(self, a: ScatterAgreement, received, out) -> object:
        """The N received copies of this rank's row -> their float32 sum (divided by `divisor`) in `out`."""
        rows = received.reshape(self.world, sum(a.lane_bytes[self.rank]))
        out.fill(np.nan)  # what stays: the blocks left out
        at = 0
        for k, fmt in enumerate(self.fmts):
            pos = 0
            for run in (u for u in a.runs[self.rank] if u.lane == k):
                codec.decode_sum_rows(rows[:, at:at + a.lane_bytes[self.rank][k]], fmt, pos, pos + run.hi - run.lo,
                                      run.shift, out=out[run.lo:run.hi])
                pos += run.hi - run.lo
            at += a.lane_bytes[self.rank][k]
        if a.divisor != 1:
            out /= np.float32(a.divisor)
        self.state.exchanged([a.name])
        return out

    def _corrected(self, name, rows):
        if not self.config.error_feedback:
            return rows
        return corrected(self.state, (name, "corrected"), (name, SEND, 0), rows.reshape(-1)).reshape(rows.shape)
