"""The codes exchange (hvd_aps.exchange driving hvd_aps._stages), with N ranks as N threads of one
process, against the independent NumPy + ml_dtypes model in tests/model.py: flat and two levels,
every schedule, error feedback, hybrid precision, stochastic rounding, a failed step."""
import concurrent.futures
import threading
import time

import numpy as np
import pytest

import hvd_aps
from hvd_aps import _host_engine, _metadata, exchange
from hvd_aps._inprocess import flat_levels, host_levels, run_ranks, subgroup_levels
from hvd_aps._schedule import BLOCK_STEPS, STEP_TRIALS, _path_text, max_trial_steps
from hvd_aps._stages import HYBRID_SAMPLE, Bucket
from hvd_aps.config import Path
import model
from support import WAIT_S, rank_grads, same_format, simulate


def assert_all_equal(results, want):
    for rank_result in results:
        for got, w in zip(rank_result, want):
            assert got.tobytes() == w.tobytes()


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn", "e5m2"])
@pytest.mark.parametrize("world, sizes", [(2, [1000, 24, 9001]), (3, [7, 10_000, 2]), (4, [5])])
def test_matches_the_model_and_is_identical_on_every_rank(fmt, world, sizes, engine):
    grads = rank_grads(world, sizes)
    results, _ = simulate(grads, same_format(fmt, world))
    assert_all_equal(results, model.flat(grads, fmt))
    unpadded, _ = simulate(grads, same_format(fmt, world), flat_levels(world, equal_allgather=False))
    assert_all_equal(unpadded, model.flat(grads, fmt))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn"])
def test_every_schedule_gives_the_same_bits(fmt):
    """Chunk sizes, a pinned one and the run-time tuning's trials, change which rank owns which
    block and how the exchange is cut into collectives, never a bit; neither does fusing the
    tensors into one bucket or exchanging them one by one."""
    grads = rank_grads(3, [1000, 24, 9001, 20_000], seed=3)
    want = model.flat(grads, fmt)
    for chunk in (0, 4 * 700, 4 * 5000, "auto"):
        compressors = same_format(fmt, 3, chunk_bytes=chunk)
        for _ in range(3 if chunk == "auto" else 1):  # tuning: a different candidate each step
            assert_all_equal(simulate(grads, compressors)[0], want)
    one_by_one = [simulate([[g[t]] for g in grads], same_format(fmt, 3), name=f"t{t}")[0][0][0] for t in range(4)]
    assert all(got.tobytes() == w.tobytes() for got, w in zip(one_by_one, want))


def test_codec_thread_count_changes_no_bit(monkeypatch):
    grads = rank_grads(2, [700_001], seed=4)  # large enough for the host engine's threads
    threaded, _ = simulate(grads, same_format("e2m1fn", 2))
    monkeypatch.setattr(_host_engine, "_pool", None)
    single, _ = simulate(grads, same_format("e2m1fn", 2))
    assert threaded[0][0].tobytes() == single[0][0].tobytes() == model.flat(grads, "e2m1fn")[0].tobytes()


def test_exchanges_beside_compute_code_on_one_thread_until_awaited(monkeypatch):
    """An exchanger's worker thread (beside the step's compute) runs the codec's calls on one
    thread, and on every thread while a caller waits for results (Exchanger.result); any other
    thread always uses every thread. The bits are the same either way."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    monkeypatch.setattr(_host_engine, "_threads", 2)
    monkeypatch.setattr(_host_engine, "_pool", pool)
    n = 1 << 20
    with pool, concurrent.futures.ThreadPoolExecutor(1, initializer=hvd_aps.codec.beside_compute) as worker:
        assert worker.submit(_host_engine._width).result(timeout=WAIT_S) == 1
        with hvd_aps.codec.awaited():
            assert worker.submit(_host_engine._width).result(timeout=WAIT_S) == 2
        assert worker.submit(_host_engine._width).result(timeout=WAIT_S) == 1
        x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
        beside = worker.submit(hvd_aps.encode, x, "e4m3").result(timeout=WAIT_S)
        assert _host_engine._width() == 2  # a thread of the caller's own
        assert beside.tobytes() == hvd_aps.encode(x, "e4m3").tobytes()
    comp = hvd_aps.APSCompressor("e4m3")
    done = concurrent.futures.Future()
    waited = []
    worker = threading.Thread(target=lambda: waited.append(comp.exchanger.result(done)), daemon=True)
    worker.start()
    deadline = time.monotonic() + WAIT_S
    try:
        while not _host_engine._awaiting[0]:  # the waiting caller widens every exchange's codec
            assert time.monotonic() < deadline, "the waiting caller never widened the codec"
            time.sleep(1e-3)
    finally:
        done.set_result([1])
    worker.join(timeout=WAIT_S)
    assert waited == [[1]] and _host_engine._awaiting[0] == 0


def test_stochastic_rounding_is_reproducible_whatever_the_schedule():
    """Seeds come from (seed, rank, tensor key, step, element): the same bits on every run and for
    every chunking; another seed, or the next step, gives other bits."""
    grads = rank_grads(3, [9001, 300], seed=5)
    runs = {}
    for seed, chunk in ((7, 0), (7, 4 * 1000), (7, "auto"), (8, 0)):
        compressors = same_format("e4m3", 3, rounding="stochastic", seed=seed, chunk_bytes=chunk)
        runs[seed, chunk] = [simulate(grads, compressors)[0][0] for _ in range(2)]
    first = runs[7, 0]
    for key in ((7, 4 * 1000), (7, "auto")):
        assert all(a.tobytes() == b.tobytes() for step, other in zip(first, runs[key]) for a, b in zip(step, other))
    assert first[0][0].tobytes() != first[1][0].tobytes()  # the step enters the seed
    assert first[0][0].tobytes() != runs[8, 0][0][0].tobytes()
    exact = np.mean([g[0].astype(np.float64) for g in grads], axis=0)
    assert np.linalg.norm(first[0][0] - exact) / np.linalg.norm(exact) < 0.1


def test_two_levels_match_the_model_of_host_sums_then_codes():
    """2 hosts x 2 ranks and 2 x 3: host sums in local-rank order in float32, then the flat
    model across hosts, divided by N; every rank ends with the same bits."""
    for hosts, local in ((2, 2), (2, 3)):
        grads = rank_grads(hosts * local, [1000, 24, 90_001, 50_000], seed=6)
        for fmt in ("e4m3", "e2m1fn"):
            results, sent = simulate(grads, same_format(fmt, hosts * local), host_levels(hosts, local))
            host_ranks = [list(range(h * local, (h + 1) * local)) for h in range(hosts)]
            assert_all_equal(results, model.two_levels(grads, fmt, host_ranks))
            # codes only between hosts: each rank sends its 1/L slice's codes, a ring of H ranks (a
            # slice, its owners' ranges and the padding to the longest owner: a block each)
            bits = 8 if fmt == "e4m3" else 4
            ring = 2 * (hosts - 1) / hosts * 141_025 * bits / 8 / local
            assert all(abs(s - ring) <= 3 * model.BLOCK * bits / 8 + 64 for s in sent), (sent, ring)


def test_two_levels_on_subgroups_of_one_group_match_the_model():
    """Subgroups of one group (Horovod's global process set without dynamic process sets): the
    same bits as two levels on groups of their own, sent only between members (each rank sends
    its slice's codes to one rank, not to all), and every rank calls every collective even where
    the local slices cut into different numbers of chunks (else they would wait for each other)."""
    hosts, local = 2, 3
    grads = rank_grads(hosts * local, [1000, 24, 90_001, 50_000], seed=6)
    host_ranks = [list(range(h * local, (h + 1) * local)) for h in range(hosts)]
    compressors = same_format("e4m3", hosts * local, chunk_bytes=4 * 6_000)  # slices of 8 and 9 chunks
    results, sent = simulate(grads, compressors, subgroup_levels(hosts, local))
    assert_all_equal(results, model.two_levels(grads, "e4m3", host_ranks))
    ring = 2 * (hosts - 1) / hosts * 141_025 / local
    assert all(abs(s - ring) <= 3 * model.BLOCK + 64 * 8 for s in sent), (sent, ring)


def test_sums_are_the_averages_times_n_before_the_division():
    grads = rank_grads(3, [500])
    sums, _ = simulate(grads, same_format("e4m3", 3), average=False)
    assert (sums[0][0] / np.float32(3)).tobytes() == model.flat(grads, "e4m3")[0].tobytes()


def test_bytes_on_the_wire():
    grads = rank_grads(4, [100_000, 60_000])
    for fmt, per_element in (("e4m3", 1.0), ("e2m1fn", 0.5)):
        _, sent = simulate(grads, same_format(fmt, 4))
        ring = 2 * 3 / 4 * 160_000 * per_element  # a ring allreduce at that many bytes per element
        # owners' ranges end on block boundaries, and every allgather is padded to the longest
        assert all(ring <= s <= ring * 1.02 for s in sent)


def test_zeros_and_non_finite_come_back_nan_on_every_rank():
    grads = rank_grads(2, [50, 60])
    grads[0][0][:] = 0
    grads[1][0][:] = 0
    grads[1][1][5] = np.nan
    results, _ = simulate(grads, same_format("e4m3", 2))
    for r in results:
        assert (r[0] == 0).all() and np.isnan(r[1]).all()


# ranks 0, 1 and 3 alike, rank 2 otherwise in two fields
MISMATCHED = [dict(fmt="e4m3"), dict(fmt="e4m3"), dict(fmt="e5m2", chunk_bytes=0), dict(fmt="e4m3")]
NAMED = ("APSCompressor settings differ between ranks: fmt: e4m3 on ranks 0-1, 3, e5m2 on rank 2; chunk_bytes: auto "
         "on ranks 0-1, 3, 0 on rank 2. Give every rank the same APSCompressor arguments")


@pytest.mark.parametrize("levels", [lambda: flat_levels(4), lambda: flat_levels(4, equal_allgather=False),
                                    lambda: host_levels(2, 2)], ids=["flat", "any_sizes", "two_levels"])
def test_a_configuration_mismatch_is_refused_on_every_rank_naming_each_ranks_value(levels):
    """Every rank raises the same error, naming each field that differs with every rank's value
    (gathered on the error path) and no field that agrees."""
    levels, grads = levels(), rank_grads(4, [10])

    def rank_error(r):
        stages = hvd_aps.APSCompressor(**MISMATCHED[r]).exchanger.stages(levels[r].cross.world, levels[r].cross.rank, r)
        with pytest.raises(ValueError) as raised:
            exchange.run(stages, Bucket.whole("bucket", ["t"], ["t"], [10]), grads[r][0], levels[r])
        return str(raised.value)
    assert run_ranks(rank_error, 4) == [NAMED] * 4


def test_a_mismatch_where_settings_cannot_be_gathered_names_this_ranks_own():
    """Inside a TF graph (no collective runs in a host stage) the agreed signatures alone tell:
    the error names this rank's settings other than the defaults."""
    config = hvd_aps.APSCompressor("e5m2", chunk_bytes=0, error_feedback=True).config
    agreed = _metadata.vector(config, [1.0], [10])
    agreed[-_metadata.TAIL + 1] = -1.0  # another rank's signature, lower
    own = r"this rank's, where not the defaults: fmt=e5m2, error_feedback=True, chunk_bytes=0\. Give"
    with pytest.raises(ValueError, match=r"differ between ranks \(their signatures range from 1 to \d+\): " + own):
        _metadata.read(config, agreed, [10], ["t"])


def test_tensors_in_another_order_are_refused_naming_the_tensor():
    grads = rank_grads(2, [100, 200])
    grads[1] = grads[1][::-1]
    with pytest.raises(ValueError, match=r"tensor 0 \(bucket\[0\]\) has 100 elements here and 100 to 200"):
        simulate(grads, same_format("e4m3", 2))


def test_a_failed_step_leaves_nothing_behind():
    """Error feedback on; a step with one rank's tensors in another order raises on every rank and
    is rolled back; the steps after it equal the model of the good steps alone, bit for bit, under
    the same names and in the same buffers."""
    world, sizes, fmt = 2, [500, 9000], "e2m1fn"
    compressors = same_format(fmt, world, error_feedback=True)
    steps = [rank_grads(world, sizes, seed=s) for s in range(3)]
    want = model.with_error_feedback(steps, fmt)
    assert_all_equal(simulate(steps[0], compressors)[0], want[0])
    buffers = [len(c.state.buffers) for c in compressors]
    bad = [g[::-1] for g in steps[1]]
    bad[0] = steps[1][0]
    with pytest.raises(ValueError, match="different tensors"):
        simulate(bad, compressors, commit=False)
    for c in compressors:
        c.state.rollback()
    for s in (1, 2):
        assert_all_equal(simulate(steps[s], compressors)[0], want[s])
    assert [len(c.state.buffers) for c in compressors] == buffers


def test_error_feedback_matches_the_model_over_steps():
    world, sizes, fmt = 3, [500, 9000], "e2m1fn"
    compressors = same_format(fmt, world, error_feedback=True, chunk_bytes=4 * 3000)
    steps = [rank_grads(world, sizes, seed=step) for step in range(3)]
    for step, want in enumerate(model.with_error_feedback(steps, fmt)):
        assert_all_equal(simulate(steps[step], compressors)[0], want)


def test_error_feedback_removes_the_bias_of_a_repeated_gradient():
    """The same gradients every step: with error feedback the mean of the results converges to
    the exact mean (what rounding drops comes back later); without, the rounding bias stays."""
    grads = rank_grads(2, [300], seed=5)
    exact = np.mean([g[0].astype(np.float64) for g in grads], axis=0)
    errors = {}
    for ef in (False, True):
        compressors = same_format("e2m1fn", 2, error_feedback=ef)
        mean = np.mean([simulate(grads, compressors)[0][0][0] for _ in range(64)], axis=0)
        errors[ef] = np.linalg.norm(mean - exact) / np.linalg.norm(exact)
    assert errors[True] < 0.05 * errors[False] and errors[False] > 0.1


@pytest.mark.parametrize("levels", ["flat", "two_levels", "subgroups"])
def test_error_feedback_residuals_follow_a_bucket_laid_out_anew(levels):
    """A bucket whose tensors come in another order from one step to the next (as DDP rebuilds
    its buckets) puts other elements on every owner and local rank: the residuals move with
    their elements, so the next step gives the bits it gives when the order never changed."""
    make = {"flat": lambda: flat_levels(4), "two_levels": lambda: host_levels(2, 2),
            "subgroups": lambda: subgroup_levels(2, 2)}[levels]
    steps = [rank_grads(4, [9000, 5000], seed=step) for step in range(2)]
    swapped = [[g[::-1] for g in step] for step in steps]
    moved, kept = (same_format("e2m1fn", 4, error_feedback=True) for _ in range(2))
    simulate(steps[0], moved, make(), keys=["a", "b"])
    simulate(swapped[0], kept, make(), keys=["b", "a"])
    got = simulate(swapped[1], moved, make(), keys=["b", "a"])[0]
    want = simulate(swapped[1], kept, make(), keys=["b", "a"])[0]
    assert all(x.tobytes() == y.tobytes() for g, w in zip(got, want) for x, y in zip(g, w))


def test_state_resumes_bit_for_bit_and_pickles():
    import pickle
    grads = [rank_grads(2, [200, 5000], seed=s) for s in range(3)]
    going = same_format("e2m1fn", 2, error_feedback=True, rounding="stochastic", seed=1)
    simulate(grads[0], going)
    saved = [c.state_dict() for c in going]
    resumed = same_format("e2m1fn", 2, error_feedback=True, rounding="stochastic")
    for c, state in zip(resumed, saved):
        c.load_state_dict(state)
    pickled = [pickle.loads(pickle.dumps(c)) for c in going]
    assert any(np.any(r) for r in saved[0]["residuals"].values()) and saved[0]["steps"]
    for g in grads[1:]:
        a, b, c = (simulate(g, comps)[0][0] for comps in (going, resumed, pickled))
        assert all(x.tobytes() == y.tobytes() == z.tobytes() for x, y, z in zip(a, b, c))


def test_hybrid_precision_sends_the_tensors_the_narrow_format_would_lose_wide():
    """e2m1fn with hybrid e4m3: a tensor with one outlier (e2m1fn flushes the rest of it) goes
    out in e4m3 on every rank, even where only one rank holds the outlier; the Gaussian ones stay
    narrow. Each tensor equals the model in its format, and the bytes count both lanes."""
    world, sizes = 3, [1000, 9001, 500]
    grads = rank_grads(world, sizes, seed=7)
    grads[1][1][7] = 1e3 * np.abs(grads[1][1]).max()  # only rank 1 holds tensor 1's outlier
    compressors = same_format("e2m1fn", world, hybrid="e4m3")
    results, sent = simulate(grads, compressors)
    narrow, wide = model.flat(grads, "e2m1fn"), model.flat(grads, "e4m3")
    assert_all_equal(results, [narrow[0], wide[1], narrow[2]])
    assert [compressors[0].stats[f"bucket[{i}]"].fmt for i in range(3)] == ["e2m1fn", "e4m3", "e2m1fn"]
    ring = 2 * (world - 1) / world * (1500 * 0.5 + 9001 * 1.0)
    assert all(ring <= s <= ring + 2 * model.BLOCK for s in sent)  # owners' ranges end on block boundaries


def test_hybrid_error_estimate_is_the_sampled_relative_error():
    """The estimate behind the hybrid choice, against ml_dtypes: the mean of |q(s) - s| / |s| over
    the strided sample's nonzero entries, at the shift this rank's amax gives."""
    x = np.random.default_rng(2).laplace(0, 1e-3, 100_000).astype(np.float32)
    stages = hvd_aps.APSCompressor("e2m1fn", hybrid="e4m3").exchanger.stages(2, 0)
    sample = x[::(x.size // HYBRID_SAMPLE) | 1]
    s = hvd_aps.scaling.shift_for(float(np.abs(x).max()), 2, "e2m1fn", model.F32_MAX)
    want = np.mean(np.abs(model.rounded(sample, "e2m1fn", s) - sample) / np.abs(sample))
    vector, _ = stages.metadata(Bucket.whole("b", ["b[0]"], ["b[0]"], [x.size]), x)
    assert vector[3] == pytest.approx(want, rel=1e-6) and 0.5 < want < 0.6  # [amax, size, -size, error, ...]


def test_policy_auto_times_whole_steps_and_decides_alike():
    """policy="auto": once the chunking is fixed, whole steps are timed with codes and with the
    framework's own allreduce (here: a thread sum, float32); the medians ride on the metadata,
    every rank decides alike, and the decision is reported and in the state_dict; native steps
    give the float32 average."""
    grads = rank_grads(2, [20_000], seed=8)
    compressors = same_format("e4m3", 2, policy="auto", chunk_bytes=0)
    exact = (grads[0][0] + grads[1][0]) / np.float32(2)
    natives = 0
    for _ in range(max_trial_steps() + 3):  # chunking, the rounds of trials and their deciding steps, decided
        native = compressors[0].state.schedule.native_dtype()
        results, _ = simulate(grads, compressors)
        if native:
            natives += 1
            assert results[0][0].tobytes() == exact.tobytes()
    policy = [c.schedule_report()[-1] for c in compressors]
    assert policy[0]["chosen"] == policy[1]["chosen"] in ("codes", "native float32")
    assert set(policy[0]["seconds"]) == {"codes step", "native float32 step"}
    assert natives >= STEP_TRIALS  # the native trial steps, and every step after if native won
    assert _path_text(Path(compressors[0].state_dict()["schedule"]["(policy)"]["chosen"])) == policy[0]["chosen"]


def test_fallback_auto_sends_each_native_dtype_as_the_framework_would():
    """fallback="auto": the trial steps go through the framework's allreduce in float32 and in
    float16 (the float16 sum of the float16 casts, as a float16 allreduce gives it), every rank
    runs the same dtype each step and decides alike, and each is counted in its dtype."""
    grads = rank_grads(2, [20_000], seed=8)
    compressors = same_format("e4m3", 2, policy="auto", fallback="auto", chunk_bytes=0)
    want = {dtype: ((grads[0][0].astype(dtype) + grads[1][0].astype(dtype)).astype(np.float32) / np.float32(2))
            for dtype in ("float32", "float16")}
    seen = set()
    for _ in range(max_trial_steps(("float32", "float16")) + 2):
        dtypes = {c.state.schedule.native_dtype() for c in compressors}
        assert len(dtypes) == 1  # alike on every rank
        dtype = dtypes.pop()
        results, _ = simulate(grads, compressors)
        if dtype is not None:
            seen.add(dtype)
            assert_all_equal(results, [want[dtype]])
            assert compressors[0].stats["bucket[0]"].fmt == dtype
    assert seen == {"float32", "float16"}
    policy = [c.schedule_report()[-1] for c in compressors]
    assert policy[0]["chosen"] == policy[1]["chosen"] in ("codes", "native float32", "native float16")


@pytest.mark.parametrize("link, chosen", [("1mbit", "codes"), ("10000gbit", "native float32")])
def test_policy_auto_with_a_link_decides_from_the_model_without_trials(monkeypatch, link, chosen):
    """HVD_APS_LINK gives policy="auto" a link: after the first block of codes steps, the
    framework's step is predicted from their median and the model's allreduce; a margin past
    PRIOR_MARGIN decides on the next step, alike on every rank, with no native trial step (a link
    far slower than the codes' own time: codes; far faster: the framework's allreduce), both
    reported."""
    monkeypatch.setenv("HVD_APS_LINK", link)
    grads = rank_grads(2, [1 << 20], seed=9)
    compressors = same_format("e4m3", 2, policy="auto")
    schedule, phases = compressors[0].state.schedule, []
    while schedule.report()[-1]["chosen"] is None and len(phases) < max_trial_steps():
        phases.append((schedule.state_dict()["(policy)"]["phase"], schedule.native_dtype()))
        simulate(grads, compressors)
    policy = [c.schedule_report()[-1] for c in compressors]
    assert policy[0]["chosen"] == policy[1]["chosen"] == chosen
    # the chunking, one block of codes steps (a warm-up and BLOCK_STEPS timed), the deciding step
    assert [p for p, _ in phases].count("trials") == 1 + BLOCK_STEPS and phases[-1][0] == "deciding"
    assert not any(native for _, native in phases)  # no native trial step
    assert schedule.native_dtype() == (None if chosen == "codes" else "float32")
    assert set(policy[0]["seconds"]) == {"codes step", "native float32 step (predicted)"}


@pytest.mark.parametrize("link, warned", [("1mbit", False), ("10000gbit", True)])
def test_policy_codes_warns_once_where_the_model_predicts_the_framework_faster(monkeypatch, caplog, link, warned):
    """policy="codes" with HVD_APS_LINK: once the chunking is fixed and a block of steps timed, one
    warning naming policy="auto" where the framework's own step is predicted PRIOR_MARGIN shorter
    (a link far faster than the codes' own time), none where codes are (far slower)."""
    monkeypatch.setenv("HVD_APS_LINK", link)
    grads = rank_grads(2, [1 << 20], seed=9)
    compressors = same_format("e4m3", 2)
    with caplog.at_level("WARNING", logger="hvd_aps"):
        for _ in range(max_trial_steps() // 2):
            simulate(grads, compressors)
    warnings = [r for r in caplog.records if "policy='auto'" in r.getMessage()]
    assert len(warnings) == (2 if warned else 0)  # once a rank, here two thread ranks
    assert not any(c.state.schedule.native_dtype() for c in compressors)  # policy="codes" sends codes
