"""The codes exchange's stages, with N ranks simulated in one process (the collectives become list
shuffles), against an independent NumPy + ml_dtypes model of the same arithmetic."""
import ml_dtypes
import numpy as np
import pytest

import hvd_aps
from hvd_aps import scaling, wire

TWINS = {"e4m3": ml_dtypes.float8_e4m3, "e2m1fn": ml_dtypes.float4_e2m1fn, "e5m2": ml_dtypes.float8_e5m2}


def simulate(grads, fmt, average=True):
    """grads[r][t]: rank r's tensor t. Runs the four stages; returns every rank's results."""
    world = len(grads)
    ex = [wire.CodesExchange(hvd_aps.APSCompressor(fmt), world, r) for r in range(world)]
    agreed = np.max([e.metadata(g) for e, g in zip(ex, grads)], axis=0)
    begun = [e.begin(g, agreed) for e, g in zip(ex, grads)]
    cuts = [np.concatenate([[0], np.cumsum(splits)]) for _, splits, _ in begun]
    received = [np.concatenate([begun[s][0][cuts[s][r]:cuts[s][r + 1]] for s in range(world)]) for r in range(world)]
    reduced = [e.reduce_shard(rcv, st) for e, rcv, (_, _, st) in zip(ex, received, begun)]
    gathered = np.concatenate(reduced)
    return [e.finish(gathered, st, average) for e, (_, _, st) in zip(ex, begun)], [st for _, _, st in begun]


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
    results, _ = simulate(grads, fmt)
    want = reference(grads, fmt)
    for rank_result in results:
        for got, w in zip(rank_result, want):
            assert got.tobytes() == w.tobytes()


def test_bytes_on_the_wire():
    grads = rank_grads(4, [100_000, 60_000])
    for fmt, per_element in (("e4m3", 1.0), ("e2m1fn", 0.5)):
        _, states = simulate(grads, fmt)
        ring = 2 * 3 / 4 * 160_000 * per_element  # a ring allreduce at that many bytes per element
        assert ring <= states[0].bytes_sent <= ring * 1.01


def test_zeros_and_non_finite():
    grads = rank_grads(2, [50, 60])
    grads[0][0][:] = 0
    grads[1][0][:] = 0
    grads[1][1][5] = np.nan
    results, states = simulate(grads, "e4m3")
    assert states[0].fallback == [1] and states[0].included == [0]
    assert (results[0][0] == 0).all() and len(results[0]) == 1


def test_metadata_mismatch_is_refused():
    ex = wire.CodesExchange(hvd_aps.APSCompressor("e4m3"), 2, 0)
    other = wire.CodesExchange(hvd_aps.APSCompressor("e5m2"), 2, 1)
    g = [np.ones(10, np.float32)]
    agreed = np.max([ex.metadata(g), other.metadata(g)], axis=0)
    with pytest.raises(ValueError, match="mismatch across ranks"):
        ex.begin(g, agreed)
