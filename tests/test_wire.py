"""The codes exchange (hvd_aps.exchange driving hvd_aps.wire's stages), with N ranks as N threads
of one process whose collectives meet at a barrier, against an independent NumPy + ml_dtypes model
of the same arithmetic."""
import concurrent.futures
import threading

import ml_dtypes
import numpy as np
import pytest

import hvd_aps
from hvd_aps import exchange, scaling, wire
from hvd_aps._arrays import array_module

TWINS = {"e4m3": ml_dtypes.float8_e4m3, "e2m1fn": ml_dtypes.float4_e2m1fn, "e5m2": ml_dtypes.float8_e5m2}


class ThreadCollectives(exchange.Eager):
    """Collectives between threads: each rank posts its part, all wait, each reads everyone's."""

    def __init__(self, world, rank, board, barrier):
        self.world, self.rank, self._board, self._barrier = world, rank, board, barrier

    def _everyone(self, name, value):
        self._board[(name, self.rank)] = value
        self._barrier.wait()
        values = [self._board[(name, r)] for r in range(self.world)]
        self._barrier.wait()
        return values

    def max_allreduce(self, vector, name):
        return np.max(self._everyone(name, vector), axis=0)

    def alltoall(self, send, splits, name):
        cuts = [np.concatenate([[0], np.cumsum(s)]) for s in self._everyone(name + ".splits", splits)]
        sent = self._everyone(name, send)
        xp = array_module(send)  # NumPy, or CuPy where the test runs the exchange on a GPU
        return xp.concatenate([sent[r][cuts[r][self.rank]:cuts[r][self.rank + 1]] for r in range(self.world)])

    def allgather(self, message, name):
        return array_module(message).concatenate(self._everyone(name, message))


def simulate(grads, compressors, average=True):
    """grads[r][t]: rank r's tensor t. Runs the driver on one thread per rank; returns every rank's
    results (averaged unless average=False) and the bytes each rank sent."""
    world, board, barrier = len(grads), {}, threading.Barrier(len(grads))

    def rank_run(r):
        coll = ThreadCollectives(world, r, board, barrier)
        sums = exchange.run(compressors[r].stages(world, r), grads[r], coll, "bucket")
        return [s / np.float32(world) if average else s for s in sums]

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank_run, range(world)))
    return results, [c.bytes_sent for c in compressors]


def same_format(fmt, world):
    return [hvd_aps.APSCompressor(fmt) for _ in range(world)]


def reference(grads, fmt, average=True):
    """The same arithmetic, written from the description in hvd_aps/wire.py with ml_dtypes."""
    world, dtype = len(grads), TWINS[fmt]
    f32_max = float(np.finfo(np.float32).max)  # shards are summed in float32: no x N headroom
    shifts = [scaling.shift_for(max(float(np.abs(g[t]).max()) for g in grads), world, fmt, f32_max)
              for t in range(len(grads[0]))]
    flat_sum = np.concatenate([
        sum_in_order([np.ldexp(np.ldexp(g[t], s).astype(dtype).astype(np.float32), -s) for g in grads])
        for t, s in enumerate(shifts)])
    sizes = [g.size for g in grads[0]]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    starts = wire.shard_starts(int(offsets[-1]), world)
    out = np.empty_like(flat_sum)
    for r in range(world):
        for t in range(len(sizes)):
            a, b = max(starts[r], offsets[t]), min(starts[r + 1], offsets[t + 1])
            if a < b:
                seg = flat_sum[a:b]
                s2 = scaling.shift_for(float(np.abs(seg).max()), 1, fmt)
                out[a:b] = np.ldexp(np.ldexp(seg, s2).astype(dtype).astype(np.float32), -s2)
    if average:
        out = out / np.float32(world)
    return [out[offsets[t]:offsets[t + 1]] for t in range(len(sizes))]


def sum_in_order(terms):
    total = np.zeros_like(terms[0])
    for t in terms:
        total = total + t
    return total


def rank_grads(world, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0)).astype(np.float32) for n in sizes]
            for _ in range(world)]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn", "e5m2"])
@pytest.mark.parametrize("world, sizes", [(2, [1000, 24, 3001]), (3, [7, 1000, 2]), (4, [5])])
def test_matches_reference_and_is_identical_on_every_rank(fmt, world, sizes, engine):
    grads = rank_grads(world, sizes)
    results, _ = simulate(grads, same_format(fmt, world))
    want = reference(grads, fmt)
    for rank_result in results:
        for got, w in zip(rank_result, want):
            assert got.tobytes() == w.tobytes()


def test_sums_are_the_averages_times_n_before_the_division():
    grads = rank_grads(3, [500])
    sums, _ = simulate(grads, same_format("e4m3", 3), average=False)
    assert (sums[0][0] / np.float32(3)).tobytes() == reference(grads, "e4m3")[0].tobytes()


def test_bytes_on_the_wire():
    grads = rank_grads(4, [100_000, 60_000])
    for fmt, per_element in (("e4m3", 1.0), ("e2m1fn", 0.5)):
        _, sent = simulate(grads, same_format(fmt, 4))
        ring = 2 * 3 / 4 * 160_000 * per_element  # a ring allreduce at that many bytes per element
        assert all(ring <= s <= ring * 1.01 for s in sent)


def test_zeros_and_non_finite_come_back_nan_on_every_rank():
    grads = rank_grads(2, [50, 60])
    grads[0][0][:] = 0
    grads[1][0][:] = 0
    grads[1][1][5] = np.nan
    results, _ = simulate(grads, same_format("e4m3", 2))
    for r in results:
        assert (r[0] == 0).all() and np.isnan(r[1]).all()


def test_a_configuration_mismatch_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="mismatch across ranks"):
        simulate(rank_grads(2, [10]), [hvd_aps.APSCompressor("e4m3"), hvd_aps.APSCompressor("e5m2")])


def test_tensors_in_another_order_are_refused_naming_the_tensor():
    grads = rank_grads(2, [100, 200])
    grads[1] = grads[1][::-1]
    with pytest.raises(ValueError, match=r"tensor 0 \(bucket\[0\]\) has 100 elements here and 100 to 200"):
        simulate(grads, same_format("e4m3", 2))
