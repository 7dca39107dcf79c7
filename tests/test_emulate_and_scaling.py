import ml_dtypes
import numpy as np
import pytest

import hvd_aps
from hvd_aps import emulate, scaling
from support import rank_grads


F32_MAX = float(np.finfo(np.float32).max)


def gaussian_ranks(n=8, size=100_000, sigma=1e-4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, sigma, size).astype(np.float32) for _ in range(n)]


def test_shift_examples():
    # 8 ranks, max |g| = 1e-4: 8e-4 * 2**s <= 240 < 2 * 8e-4 * 2**s  ->  s = 18
    assert scaling.shift_for(1e-4, 8, hvd_aps.e4m3) == 18
    assert scaling.shift_for(1e-4, 8, hvd_aps.e4m3fn) == 19  # 448 has one more binade than 240
    assert scaling.shift_for(0.0, 8, hvd_aps.e4m3) == 0
    assert scaling.shift_for(np.inf, 8, hvd_aps.e4m3) == 0
    assert scaling.shifts_for([1e-4, 0.0, 1e3], 8, "e5m2").tolist() == [25, 0, 2]  # 26 if terms never rounded up
    # the headroom follows the accumulator: a float16 sum has room for 272 e4m3 maxima, float32 for all
    assert scaling.shift_for(1e-4, 8, hvd_aps.e4m3, sum_max=65504.0) == 21
    # in-format: 32 rounded terms (each may grow by half an ulp, at least half the smallest value) must fit 8
    assert scaling.shift_for(1.0, 32, hvd_aps.e3m0) == -3 and scaling.shift_for(1.0, 32, hvd_aps.e3m0, F32_MAX) == 3
    assert scaling.shift_for(1.0, 4, hvd_aps.e5m2, sum_max=65504.0) == 13  # 4 x 2**14 > 65504: float16 binds
    # two e5m2 terms of 32752 would round to 32768 each and overflow a float16 sum: one binade less
    assert scaling.shift_for(32752.0, 2, hvd_aps.e5m2, sum_max=65504.0) == -1
    with pytest.raises(ValueError, match="world_size"):
        scaling.shift_for(1.0, 0, hvd_aps.e4m3)
    with pytest.raises(ValueError, match=">= 0"):
        scaling.shift_for(-1.0, 2, hvd_aps.e4m3)


def test_emulated_allreduce_equals_an_ml_dtypes_reference():
    arrays = gaussian_ranks(4, 10_000)
    s = scaling.shift_for(max(float(np.abs(a).max()) for a in arrays), 4, hvd_aps.e4m3, F32_MAX)
    terms = [np.ldexp(a, s).astype(ml_dtypes.float8_e4m3).astype(np.float32) for a in arrays]
    acc = np.zeros_like(arrays[0])
    for t in terms:
        acc = acc + t
    want = np.ldexp(acc, -s).astype(np.float32) / np.float32(4)
    got = emulate.allreduce(arrays, "e4m3")
    assert got.dtype == np.float32 and (got == want).all()


def test_in_format_accumulation_rounds_every_partial_sum():
    arrays = gaussian_ranks(4, 10_000)
    s = scaling.shift_for(max(hvd_aps.amax(a) for a in arrays), 4, hvd_aps.e5m2)
    terms = [np.ldexp(a, s).astype(ml_dtypes.float8_e5m2).astype(np.float32) for a in arrays]
    acc = terms[0]
    for t in terms[1:]:
        acc = (acc + t).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    want = np.ldexp(acc, -s).astype(np.float32) / np.float32(4)
    assert (emulate.allreduce(arrays, "e5m2", accumulate="format") == want).all()


def test_aps_rescues_small_gradients_and_the_naive_cast_loses_them():
    arrays = gaussian_ranks()
    with_aps = emulate.relative_error(emulate.allreduce(arrays, "e4m3"), arrays)
    naive = emulate.relative_error(emulate.allreduce(arrays, "e4m3", scaling="none"), arrays)
    assert with_aps < 0.03
    assert naive == 1.0  # every value is below e4m3's smallest subnormal: all flushed to zero
    in_format = emulate.relative_error(emulate.allreduce(arrays, "e4m3", accumulate="format"), arrays)
    kahan = emulate.relative_error(emulate.allreduce(arrays, "e4m3", accumulate="format", kahan=True), arrays)
    assert with_aps <= in_format and kahan <= in_format


def test_zeros_stay_zeros_and_non_finite_stays_visible():
    zeros = [np.zeros(100, np.float32)] * 4
    out = emulate.allreduce(zeros, "e3m0")
    assert (out == 0).all()
    arrays = gaussian_ranks(4, 100)
    for bad in (np.nan, np.inf):
        poisoned = [a.copy() for a in arrays]
        poisoned[2][7] = bad
        for fmt in ("e4m3", "e2m1fn"):  # e2m1fn has neither NaN nor Inf
            out = emulate.allreduce(poisoned, fmt)
            assert not np.isfinite(out[7]) and np.isfinite(np.delete(out, 7)).all()


def test_stochastic_emulation_is_reproducible():
    arrays = gaussian_ranks(4, 1000)
    a = emulate.allreduce(arrays, "e3m0", rounding="stochastic", seed=5)
    b = emulate.allreduce(arrays, "e3m0", rounding="stochastic", seed=5)
    assert (a == b).all()


def test_emulator_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        emulate.allreduce([], "e4m3")
    with pytest.raises(ValueError, match="one shape"):
        emulate.allreduce([np.zeros(3), np.zeros(4)], "e4m3")
    with pytest.raises(ValueError, match="accumulate"):
        emulate.allreduce([np.zeros(3)], "e4m3", accumulate="fp16")


def test_probe_rows():
    rows = emulate.probe("e4m3", ranks=8, size=20_000)
    assert [(r[1], r[2]) for r in rows] == [("aps", "fp32"), ("aps", "format"), ("none", "fp32"), ("none", "format")]
    assert rows[0][3] < 0.03 and rows[2][3] == 1.0


def test_two_level_results_are_reused_only_when_nothing_holds_them():
    """With no arrays given for them, two levels write each step's results into the arrays of the
    step before where nothing outside holds those any more, and into new ones where something
    does: results kept by the caller never change, and every step's match the NumPy model."""
    import weakref

    import model
    from hvd_aps import _inprocess
    from hvd_aps._stages import Bucket
    levels, world = _inprocess.host_levels(2, 2), 4
    compressors = [hvd_aps.APSCompressor("e4m3") for _ in range(world)]
    bucket = Bucket.whole("held", ["held[0]"], ["held[0]"], [5000])

    def step(seed):
        grads, out = rank_grads(world, [5000], seed=seed), [None] * world

        def worker(w):
            done = compressors[w].exchanger.bucket(levels[w], bucket, grads[w][0], threaded=False, average=True)
            out[w] = done.result()  # bounded: threaded=False ran the exchange here
            compressors[w].exchanger.end_step()
        _inprocess.run_ranks(worker, world)
        want = model.two_levels(grads, "e4m3", [[0, 1], [2, 3]])[0]
        assert all(o.tobytes() == want.tobytes() for o in out), seed
        return out, want

    first, first_want = step(0)
    second, _ = step(1)
    assert all(o.tobytes() == first_want.tobytes() for o in first)  # held, so not written again
    kept = [weakref.ref(o) for o in second]  # alive after the del only if the exchange keeps them
    del first, second
    third, _ = step(2)
    assert all(ref() is o for ref, o in zip(kept, third))


def test_codes_allreduce_runs_the_driver_flat_and_on_two_levels():
    """The emulator is the exchange real ranks run (one driver on thread ranks): against the
    independent NumPy model, flat with error feedback over two steps (each step's results its
    own arrays, not buffers the next step reuses), and two hosts of two workers."""
    import model
    steps = [rank_grads(3, [900, 40], seed=s) for s in range(2)]
    compressors = [hvd_aps.APSCompressor("e2m1fn", error_feedback=True) for _ in range(3)]
    got = [emulate.codes_allreduce(compressors, grads) for grads in steps]
    for step, want in zip(got, model.with_error_feedback(steps, "e2m1fn")):
        assert [g.tobytes() for g in step] == [w.tobytes() for w in want]
    grads = rank_grads(4, [5000, 70], seed=3)
    got = emulate.codes_allreduce([hvd_aps.APSCompressor("e4m3") for _ in range(4)], grads, ranks_per_host=2)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in model.two_levels(grads, "e4m3", [[0, 1], [2, 3]])]
    with pytest.raises(ValueError, match="ranks_per_host"):
        emulate.codes_allreduce([hvd_aps.APSCompressor("e4m3") for _ in range(4)], grads, ranks_per_host=3)
