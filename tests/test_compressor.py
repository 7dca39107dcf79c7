"""APSCompressor's framework-neutral parts, called directly (no Horovod processes): the values
wire, stats, configuration and recipes, the token, the public surface and the lifecycle."""
import itertools
import pickle
import types
import warnings

import numpy as np
import pytest

import hvd_aps
from hvd_aps import _tokens, _values
from hvd_aps._stats import STATS_SAMPLE
from hvd_aps.config import Path
from support import WAIT_S


def to_wire(comp, x, amax, world=2, label="g"):
    return _values.to_wire(comp.config, comp.recorder, x, amax, world, 0, label)


def test_to_wire_is_the_scaled_grid_in_float16_and_from_wire_undoes_the_shift():
    comp = hvd_aps.APSCompressor("e4m3", wire="values")
    x = np.random.default_rng(0).normal(0, 1e-4, 1000).astype(np.float32)
    wire, shift = to_wire(comp, x, float(np.abs(x).max()), 4)
    assert wire.dtype == np.float16 and shift == hvd_aps.scaling.shift_for(float(np.abs(x).max()), 4, "e4m3", 65504.0)
    assert (wire.astype(np.float32) == hvd_aps.quantize(x, "e4m3", shift=shift, unscale=False)).all()
    assert (_values.from_wire(wire, shift) == hvd_aps.quantize(x, "e4m3", shift=shift)).all()
    assert _values.carrier(hvd_aps.FloatFormat.parse("e6m2")) == np.float32  # beyond float16's range


def test_stats_and_totals():
    comp = hvd_aps.APSCompressor("e4m3", scaling="none", wire="values")
    x = np.array([0.0, 1e-6, 1e-6, 1.0, 1000.0], np.float32)  # two flushed, one beyond max (240)
    to_wire(comp, x, 1000.0, label="a")
    to_wire(comp, x[:4], 1.0, label="b")
    a, total = comp.stats["a"], comp.totals()
    assert (a.nonzero, a.flushed_count, a.saturated, a.bytes_in, a.bytes_carried) == (4, 2, 1, 20, 10)
    assert (total.elements, total.nonzero, total.flushed_count, total.saturated) == (9, 7, 4, 1)
    assert total.flushed == pytest.approx(4 / 7) and "57.14% of nonzero values flushed" in str(total)
    comp.reset_stats()
    assert comp.totals().elements == 0 and comp.stats == {}


def test_non_finite_agreed_max_sends_the_tensor_unscaled():
    comp = hvd_aps.APSCompressor("e2m1fn", wire="values")
    x = np.array([1e-3, 2.0, -3.0], np.float32)
    wire, shift = to_wire(comp, x, float("inf"))
    assert shift == 0 and (wire == x.astype(np.float16)).all() and not comp.stats["g"].finite


def test_signature_and_repr_cover_every_option():
    """Two ranks configured apart are told apart, and the error shows every field."""
    variants = [hvd_aps.APSCompressor(f, rounding=r, scaling=s, saturate=t)
                for f in ("e4m3", "e4m3fn", "e5m2", "e3m0") for r in ("nearest", "stochastic")
                for s in ("aps", "none") for t in (False, True)]
    variants += [hvd_aps.APSCompressor("e4m3", chunk_bytes=c) for c in (0, 1 << 20)]
    variants += [hvd_aps.APSCompressor("e4m3", hierarchical=h) for h in (True, False)]
    variants += [hvd_aps.APSCompressor("e4m3", policy="auto", fallback=f) for f in ("float32", "float16")]
    variants += [hvd_aps.APSCompressor("e4m3", timeout=t) for t in (5, 60)]
    assert len({c.config.signature for c in variants}) == len(variants)
    assert len({repr(c) for c in variants}) == len(variants)
    text = repr(hvd_aps.APSCompressor("e4m3", chunk_bytes=0))
    assert text.startswith("APSCompressor('e4m3', rounding='nearest'") and "chunk_bytes=0" in text
    for field in ("bucket_bytes", "min_elements", "error_feedback", "hybrid", "hierarchical", "policy", "fallback",
                  "timeout"):
        assert f"{field}=" in text


def test_configuration_is_validated_once_and_frozen():
    for kwargs, match in ((dict(rounding="up"), "rounding"), (dict(scaling=None), "scaling"),
                          (dict(wire="float16"), "wire"), (dict(bucket_bytes=-1), "bucket_bytes"),
                          (dict(min_elements=2.5), "min_elements"), (dict(chunk_bytes="fast"), "chunk_bytes"),
                          (dict(policy="always"), "policy"), (dict(fallback="int8"), "fallback"),
                          (dict(timeout=0), "timeout"), (dict(timeout=float("inf")), "timeout"),
                          (dict(timeout="30"), "timeout")):
        with pytest.raises(ValueError, match=match):
            hvd_aps.APSCompressor("e4m3", **kwargs)
    for kwargs, match in ((dict(saturate="yes"), "saturate"), (dict(hierarchical="auto"), "hierarchical")):
        with pytest.raises(TypeError, match=match):
            hvd_aps.APSCompressor("e4m3", **kwargs)
    config = hvd_aps.APSCompressor("e4m3").config
    assert config == hvd_aps.APSConfig(hvd_aps.e4m3) and config.bucket_bytes == 16 << 20
    assert config.rounding is hvd_aps.Rounding.NEAREST and config.rounding == "nearest"
    with pytest.raises(Exception, match="frozen|assign"):
        config.rounding = "stochastic"


def test_recipes_name_configurations():
    comp = hvd_aps.APSCompressor.from_recipe("aps-e2m1fn-ef-hybrid", chunk_bytes=0)
    assert comp.config == hvd_aps.APSConfig("e2m1fn", error_feedback=True, hybrid="e4m3", chunk_bytes=0)
    assert hvd_aps.recipe("naive-e5m2").scaling == "none" and hvd_aps.recipe("aps-e4m3-values").wire == "values"
    with pytest.raises(ValueError, match="unknown recipe"):
        hvd_aps.recipe("aps-e4m3-fast")
    assert hvd_aps.APSCompressor("e4m3").compress([1, 2]) == ([1, 2], None)  # not a tensor: passed through


def test_the_public_surface():
    public = {name for name in dir(hvd_aps) if not name.startswith("_")}
    assert set(hvd_aps.__all__) <= public
    assert not {"wire", "tokens", "exchange", "compressor", "config"} & set(hvd_aps.__all__)
    import inspect
    sig = inspect.signature(hvd_aps.APSCompressor.__init__)
    assert all(p.annotation is not inspect.Parameter.empty for name, p in sig.parameters.items() if name != "self")


def test_token_value_says_what_horovod_did():
    total = np.array([3.0, -6.0], np.float32)
    tokens_of = [_tokens.token_values(r) for r in range(3)]
    summed = np.sum(tokens_of, axis=0)
    assert (_tokens.apply_op(total.copy(), summed * np.float32(0.33333334), 3) == total / np.float32(3)).all()
    assert (_tokens.apply_op(total.copy(), summed, 3) == total).all()  # Sum
    assert (_tokens.apply_op(total.copy(), summed * 0.5, 3) == total * np.float32(0.5)).all()  # a custom postscale
    adasum_of_two = np.array([1.25, 0.75])  # Adasum([1, 0], [1, 1])
    for not_a_sum, world in ((np.max(tokens_of, axis=0), 3), (np.min(tokens_of, axis=0), 3), (adasum_of_two, 2)):
        with pytest.raises(ValueError, match="wire='values'"):
            _tokens.apply_op(total, not_a_sum, world)


def test_a_batch_averaged_by_its_exchange_comes_back_as_it_is():
    total = np.array([1.0, -4.0], np.float32)
    tokens = np.sum([_tokens.token_values(r) for r in range(4)], axis=0)
    average = tokens * np.float32(0.25)
    learning = _tokens.Reduction()
    assert (_tokens.apply_op(total.copy(), average, 4, learning) == total / np.float32(4)).all()
    assert (_tokens.apply_op(total.copy(), tokens, 4, learning) == total).all()
    assert learning.said_average == [True, False]
    averaged = _tokens.Reduction(averaged=True)
    assert (_tokens.apply_op(total.copy(), average, 4, averaged) == total).all()  # divided already
    with pytest.raises(RuntimeError, match="Use one APSCompressor for each reduction"):
        _tokens.apply_op(total.copy(), tokens, 4, averaged)


def test_a_steps_unread_tokens_are_checked_at_once_as_each_alone():
    """check_unread reads the averaged batches' tokens in one go and checks them as apply_op
    checks each: averages recorded, a Sum's token refused, a reduction that is no sum refused."""
    class Rows:  # an adapter's read_tokens: the tokens as rows, in one read
        reads = 0

        @classmethod
        def read_tokens(cls, tokens):
            cls.reads += 1
            return [list(token) for token in tokens]

    summed = np.sum([_tokens.token_values(r) for r in range(4)], axis=0)

    def launched(*batches_tokens):
        out = []
        for tokens in batches_tokens:
            reduction = _tokens.Reduction(averaged=True)
            reduction.unread = [(token, 4) for token in tokens]
            out.append(types.SimpleNamespace(adapter=Rows, reduction=reduction))
        return out

    steps = launched([summed * np.float32(0.25)] * 3, [summed * np.float32(0.25)])
    _tokens.check_unread(steps)
    assert [b.reduction.said_average for b in steps] == [[True] * 3, [True]] and Rows.reads == 1
    with pytest.raises(RuntimeError, match="Use one APSCompressor for each reduction"):
        _tokens.check_unread(launched([summed * np.float32(0.25)], [summed * np.float32(0.25), summed]))
    with pytest.raises(ValueError, match="wire='values'"):
        _tokens.check_unread(launched([summed * np.float32(0.25), np.array([1.0, 3.0], np.float32)]))


def test_missing_host_engine_warns_once(monkeypatch):
    monkeypatch.setattr(hvd_aps.codec._host_engine, "available", False)
    monkeypatch.delenv("HVD_APS_ENGINE", raising=False)
    hvd_aps.codec._warn_numpy_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="host engine .* is not built"):
        assert hvd_aps.codec.engine_name() == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_aps.codec.engine_name()  # said once per process


def exchanged(comp, tensors, name="b"):
    """The codes exchange of `tensors` (one bucket, each tensor labelled by its key), as rank 0
    of 2 ranks that hold the same gradients: what the exchange records of this rank's encode."""
    from hvd_aps import calibration, exchange
    from hvd_aps._stages import Bucket
    keys = list(tensors)
    bucket = Bucket.whole(name, keys, keys, [tensors[k].size for k in keys])
    flat = np.concatenate([tensors[k].ravel() for k in keys])
    exchange.run(comp.exchanger.stages(2, 0), bucket, flat, exchange.Levels.flat(calibration.Mirror(2)),
                 average=True)
    comp.state.commit()


def relative_error(x, fmt, shift, **options):
    sent = hvd_aps.quantize(x, fmt, shift=shift, **options).astype(np.float64)
    return np.linalg.norm(sent - x) / np.linalg.norm(x.astype(np.float64))


def test_stats_measure_the_encode_error_on_both_wires():
    """relative_error = ||q(g) - g|| / ||g||, against quantize() computed here, for the values
    wire and for the codes wire (the exchange's record of what each rank encoded)."""
    x = np.random.default_rng(3).normal(0, 1e-3, (40, 50)).astype(np.float32)
    comp = hvd_aps.APSCompressor("e3m0", wire="values")
    _, shift = to_wire(comp, x, float(np.abs(x).max()), label="w")
    want = relative_error(x, "e3m0", shift)
    assert comp.stats["w"].relative_error == pytest.approx(want, rel=1e-9) and want > 0.05

    codes_comp = hvd_aps.APSCompressor("e3m0", chunk_bytes=0)
    exchanged(codes_comp, {"c": np.linspace(-1, 1, 3, dtype=np.float32), "d": x})  # "d" starts mid-byte
    d = codes_comp.stats["d"]
    assert d.shift == hvd_aps.scaling.shift_for(float(np.abs(x).max()), 2, "e3m0", float(np.finfo(np.float32).max))
    want_d = relative_error(x, "e3m0", d.shift)
    assert d.relative_error == pytest.approx(want_d, rel=1e-9) and d.measured == d.elements == x.size
    total = codes_comp.totals() + comp.totals()
    squares = [(s.error_sq, s.norm_sq) for s in (codes_comp.stats["c"], d, comp.stats["w"])]
    assert total.relative_error == pytest.approx(np.sqrt(sum(e for e, _ in squares) / sum(n for _, n in squares)))
    table, csv = codes_comp.stats_table(), codes_comp.stats_table(csv=True)
    assert csv.splitlines()[0] == ("tensor,format,elements,measured,shift,flushed,saturated,relative_error,"
                                   "bytes_in,bytes_carried")
    assert csv.splitlines()[2].startswith(f"d,e3m0,2000,2000,{d.shift},") and f"{want_d:.4e}" in csv
    assert table.split()[:2] == ["tensor", "format"] and "relative encode error" in str(total)


def test_sampled_stats_estimate_the_whole_tensor():
    """Stats of a 4M-element tensor from a strided sample of 65536: within a few per cent of
    every element's figures (a heavy-tailed tensor, so flushed and saturated counts are not 0)."""
    x = np.random.default_rng(4).laplace(0, 2.0, 1 << 22).astype(np.float32)  # e3m0's max 16: |x| > 16 saturates
    options = dict(scaling="none", saturate=True, chunk_bytes=0)
    exact = hvd_aps.APSCompressor("e3m0", stats_sample=0, **options)
    sampled = hvd_aps.APSCompressor("e3m0", stats_sample=1 << 16, **options)
    for comp in (exact, sampled):
        exchanged(comp, {"x": x})
    e, s = exact.stats["x"], sampled.stats["x"]
    assert e.relative_error == pytest.approx(relative_error(x, "e3m0", 0, saturate=True), rel=1e-9)
    assert e.measured == x.size and 0.9 * 65536 <= s.measured <= 65536 and s.elements == x.size
    assert s.relative_error == pytest.approx(e.relative_error, rel=0.05) and e.relative_error > 0.1
    assert s.flushed == pytest.approx(e.flushed, rel=0.05) and e.flushed > 0.01
    assert s.saturated == pytest.approx(e.saturated, rel=0.2) and e.saturated > 100
    assert "sampled elements" in str(s) and "sampled" not in str(e)


def test_a_tensor_cut_into_pieces_is_sampled_as_often_as_whole():
    """The exchange encodes a tensor in pieces (chunks, destination ranks): each piece's stats
    sample the tensor's own grid, so the default sample costs the same however many pieces there
    are, and the pieces' sum is the whole tensor's figures."""
    x = np.random.default_rng(5).laplace(0, 1e-3, 1 << 20).astype(np.float32)
    whole, pieces = (hvd_aps.APSCompressor("e4m3", chunk_bytes=c) for c in (0, 4 * 40_000))
    exchanged(whole, {"x": x})
    exchanged(pieces, {"x": x})
    assert pieces.schedule_report()[0]["chosen"] == "codes in 156 KiB chunks"
    w, p = whole.stats["x"], pieces.stats["x"]
    assert p.measured == w.measured <= STATS_SAMPLE + 1 and p.elements == x.size
    assert (p.nonzero, p.flushed_count, p.saturated, p.bytes_carried) == (w.nonzero, w.flushed_count, w.saturated,
                                                                          w.bytes_carried)
    assert p.relative_error == pytest.approx(w.relative_error, rel=1e-9)


def test_hybrid_configuration_is_checked_and_signed():
    with pytest.raises(ValueError, match="wider format than e4m3"):
        hvd_aps.APSCompressor("e4m3", hybrid="e3m0")
    with pytest.raises(ValueError, match="hybrid needs wire='codes'"):
        hvd_aps.APSCompressor("e3m0", wire="values", hybrid="e4m3")
    with pytest.raises(ValueError, match="hybrid_threshold"):
        hvd_aps.APSCompressor("e3m0", hybrid="e4m3", hybrid_threshold=0)
    signatures = {hvd_aps.APSCompressor("e3m0", hybrid=h, hybrid_threshold=t).config.signature
                  for h, t in ((None, 0.75), ("e4m3", 0.75), ("e5m2", 0.75), ("e4m3", 0.5))}
    assert len(signatures) == 4 and max(signatures) < 2 ** 53


def test_close_stops_the_threads_and_refuses_more_work():
    with hvd_aps.APSCompressor("e4m3") as comp:
        assert comp.state.workers().submit(lambda: 7).result(timeout=WAIT_S) == 7
    with pytest.raises(RuntimeError, match="closed"):
        comp.state.workers()


def test_a_compressor_pickles_with_its_state():
    comp = hvd_aps.APSCompressor("e2m1fn", error_feedback=True, seed=3, chunk_bytes=0)
    comp.state.residuals.next(("t", "send", 0), 4, np).fill(0.5)
    comp.state.exchanged(["t"])
    comp.state.commit()
    copy = pickle.loads(pickle.dumps(comp))
    assert copy.config == comp.config and copy.seed == 3
    assert copy.state_dict()["steps"] == {"t": 1}
    assert (copy.state_dict()["residuals"]["t|send|0"] == 0.5).all()


def test_commit_and_rollback():
    """A step's residuals and step counts count only once it commits; a rolled-back step leaves
    the state as it was."""
    state = hvd_aps.APSCompressor("e4m3", error_feedback=True).state
    state.residuals.next(("t", "send", 0), 3, np)[:] = 1
    state.exchanged(["t"])
    state.rollback()
    assert (state.residuals.committed(("t", "send", 0), 3, np) == 0).all() and state.step_of("t") == 0
    state.residuals.next(("t", "send", 0), 3, np)[:] = 2
    state.exchanged(["t"])
    state.commit()
    assert (state.residuals.committed(("t", "send", 0), 3, np) == 2).all() and state.step_of("t") == 1
    seed = state.seed_for(0, "t", "send")
    assert seed != state.seed_for(1, "t", "send") and seed == state.seed_for(0, "t", "send")


def test_chunkings_are_judged_by_whole_steps_not_after_a_switch(monkeypatch):
    """Two buckets on trial step by step: each candidate runs for TRIALS timed steps, both
    buckets alike; the step that first runs a candidate (a bucket's first, or after a switch:
    Horovod renegotiates new chunk names) is not timed; each timed step rides on the next step's
    metadata with its candidate; the decision is the least median step. Here 4 MiB chunks make
    the shorter steps though switching to them costs a slow first step (an exchange's own time
    would not see what the other bucket's exchange costs beside it)."""
    from hvd_aps import _schedule
    step_seconds, first_after_switch = {0: 0.5, 4 << 20: 0.3, 1 << 20: 0.4}, 2.0
    now = [0.0]
    monkeypatch.setattr(_schedule.time, "perf_counter", lambda: now[0])
    schedule = _schedule.Schedule((0, 4 << 20, 1 << 20))
    ran, before = [], None
    for _ in range(20):
        candidates = {name: schedule.candidate(name) for name in ("b0", "b1")}
        assert len(set(candidates.values())) == 1  # every bucket of a step runs alike
        c = candidates["b0"]
        for name in candidates:  # the metadata: the slowest rank's entries (one rank here), then the exchange
            schedule.agreed(name, schedule.entries(name))
            schedule.ran(name, c)
        now[0] += step_seconds[c] + (first_after_switch if c != before else 0.0)
        schedule.commit()
        ran.append(c)
        before = c
    report = {row["bucket"]: row for row in schedule.report()}
    assert report["b0"]["chosen"] == report["b1"]["chosen"] == "codes in 4096 KiB chunks"
    assert report["b0"]["seconds"] == pytest.approx({"unchunked codes": 0.5, "codes in 4096 KiB chunks": 0.3,
                                                     "codes in 1024 KiB chunks": 0.4})  # no switch's first step
    tried = [c for c, _ in itertools.groupby(ran)]
    assert tried == [0, 4 << 20, 1 << 20, 4 << 20]  # each in one run of steps, then the decision
    assert all(ran.count(c) >= 1 + _schedule.TRIALS for c in step_seconds)


def by_path(named: dict) -> dict:
    """{path name: value} -> {Path: value}, as the schedule's internals hold them."""
    return {Path(name): value for name, value in named.items()}


def _commits(schedule, steps: int) -> list:
    """The native dtype each of `steps` steps runs (None: codes), committing each."""
    phases = []
    for _ in range(steps):
        phases.append(schedule.native_dtype())
        schedule.commit()
    return phases


def _blocks(order) -> list:
    """The native dtype of every step of a round of trial blocks in `order`, then its deciding step."""
    from hvd_aps._schedule import BLOCK_STEPS, CODES, WARMUP_STEPS
    return [None if path == CODES else path for path in order for _ in range(WARMUP_STEPS + BLOCK_STEPS)] + [None]


def test_policy_auto_switches_only_between_steps():
    """The step trials' verdict rides on the deciding step's exchanges, and only the step's commit
    applies it: a step whose first exchange had agreed while another rank was still forming its
    next batch would otherwise send that batch differently there (and hang)."""
    from hvd_aps._schedule import STEP_TRIALS, UNMEASURED, Schedule, trial_order, trial_steps
    schedule = Schedule((0,), auto=True)
    assert schedule.candidate("b") == 0 and schedule.native_dtype() is None  # one chunking: fixed at once
    schedule.commit()  # every bucket's chunking fixed: the trial steps start
    order = trial_order(("codes", "float32"))
    assert order == ("codes", "float32", "codes", "float32")  # alternating blocks
    assert _commits(schedule, trial_steps(("codes", "float32"))) == _blocks(order)
    assert [len(v) for v in schedule.state_dict()["(policy)"]["steps"].values()] == [STEP_TRIALS] * 2
    codes, native = schedule.entries("b")[2:4]
    assert codes > 0 and native > 0 and schedule.entries("b")[4:] == [UNMEASURED, UNMEASURED]
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 2.0, 1.0, UNMEASURED, UNMEASURED])  # float32 faster (slowest rank)
    assert schedule.native_dtype() is None  # not within the deciding step
    schedule.commit()
    assert schedule.native_dtype() == "float32" and schedule.report()[-1]["chosen"] == "native float32"


def test_policy_auto_times_every_path_again_recheck_steps_after_deciding_and_resumes_the_count():
    """RECHECK_STEPS steps after a decision the paths are weighed again as at the start: a codes
    step for the chunkings, then a fresh round of trial blocks (codes first, timed anew), decided
    again; the steps counted so far are in the state_dict, so a
    resumed run re-checks where the uninterrupted one would; a pinned decision never re-checks."""
    from hvd_aps._schedule import RECHECK_STEPS, STEP_TRIALS, UNMEASURED, Schedule, trial_order, trial_steps
    paths = ("codes", "float32")
    native = [UNMEASURED, UNMEASURED, 2.0, 1.0, UNMEASURED, UNMEASURED]  # float32 faster (slowest rank)

    def decided():
        schedule = Schedule((0,), auto=True)
        schedule.candidate("b")
        schedule.commit()
        _commits(schedule, trial_steps(paths) - 1)
        schedule.agreed("b", native)
        schedule.commit()
        assert schedule.native_dtype() == "float32"
        return schedule

    schedule = decided()
    assert _commits(schedule, RECHECK_STEPS - 1) == ["float32"] * (RECHECK_STEPS - 1)
    resumed = Schedule((0,), auto=True)
    resumed.load_state_dict(schedule.state_dict())
    for run in (schedule, resumed):
        assert _commits(run, 1) == ["float32"]  # the last step before the re-check
        assert run.report()[-1]["chosen"] is None and run.decisions()["policy"] is None
        assert _commits(run, 1) == [None]  # codes while the chunkings are checked, as at the start
        assert _commits(run, trial_steps(paths) - 1) == _blocks(trial_order(paths))[:-1]
        assert [len(v) for v in run.state_dict()["(policy)"]["steps"].values()] == [STEP_TRIALS] * 2
        run.agreed("b", [UNMEASURED, UNMEASURED, 0.5, 1.0, UNMEASURED, UNMEASURED])  # codes faster now
        run.commit()
        assert run.native_dtype() is None and run.report()[-1]["chosen"] == "codes"
    pinned = Schedule((0,), auto=True)
    pinned.pin({"policy": "native"})
    assert set(_commits(pinned, RECHECK_STEPS + 1)) == {"float32"}


def test_policy_auto_times_every_path_again_when_kept_codes_drift(monkeypatch):
    """Codes kept: each DRIFT_WINDOW codes steps' median is weighed against the first window's
    after the decision, its share away rides on the metadata (the Max over ranks), and the commit
    of the step that agreed one past DRIFT_MARGIN starts the trials again, on every rank alike
    (also where this rank's own steps held), and the next window is twice as long; a failed
    step's agreement is dropped, the settled median survives a checkpoint, and codes pinned are
    never re-checked."""
    import types
    from hvd_aps import _schedule
    from hvd_aps._schedule import DRIFT_MARGIN, DRIFT_WINDOW, UNMEASURED, Schedule, trial_order, trial_steps
    paths = ("codes", "float32")
    now = [0.0]
    monkeypatch.setattr(_schedule, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    codes_faster = [UNMEASURED, UNMEASURED, 0.5, 1.0, UNMEASURED, UNMEASURED]

    def steps(schedule, n, seconds):
        for _ in range(n):
            now[0] += seconds
            schedule.commit()

    def drift(share):
        return [UNMEASURED, UNMEASURED, share, UNMEASURED, UNMEASURED, UNMEASURED]

    schedule = Schedule((0,), auto=True)
    schedule.candidate("b")
    steps(schedule, trial_steps(paths), 0.1)
    schedule.agreed("b", codes_faster)
    steps(schedule, 1, 0.1)
    assert schedule.native_dtype() is None and schedule.report()[-1]["chosen"] == "codes"
    assert schedule.entries("b")[2] == UNMEASURED  # nothing to weigh before the first window settles
    steps(schedule, DRIFT_WINDOW, 0.1)  # settled: 100 ms
    steps(schedule, DRIFT_WINDOW, 0.11)  # 10 % slower: within the margin
    assert schedule.entries("b")[2] == pytest.approx(0.1)
    schedule.agreed("b", drift(0.1))
    steps(schedule, 1, 0.11)
    assert schedule.report()[-1]["chosen"] == "codes"
    assert schedule.report()[-1]["seconds"]["codes step (settled)"] == pytest.approx(0.1)
    resumed = Schedule((0,), auto=True)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.entries("b")[2] == pytest.approx(0.1)
    steps(schedule, DRIFT_WINDOW, 0.12)  # weighed against the settled window, not the one before
    assert schedule.entries("b")[2] == pytest.approx(0.2)
    schedule.agreed("b", drift(DRIFT_MARGIN + 0.05))  # another rank's steps moved
    schedule.rollback()  # that step failed: its agreement does not count
    steps(schedule, 1, 0.11)
    assert schedule.report()[-1]["chosen"] == "codes"
    for run in (schedule, resumed):
        run.agreed("b", drift(DRIFT_MARGIN + 0.05))
        steps(run, 1, 0.11)
        assert run.report()[-1]["chosen"] is None  # every path timed again, as at the start
        assert _commits(run, 1) == [None]
        assert _commits(run, trial_steps(paths) - 1) == _blocks(trial_order(paths))[:-1]
        run.agreed("b", codes_faster)
        run.commit()
        assert run.state_dict()["(policy)"]["drift"]["steps"] == 2 * DRIFT_WINDOW  # re-checked by drift: rarer
    earlier = schedule.state_dict()  # an earlier release's state, without the drift: watched afresh
    del earlier["(policy)"]["drift"]
    older = Schedule((0,), auto=True)
    older.load_state_dict(earlier)
    assert older.entries("b")[2] == UNMEASURED and older.report()[-1]["chosen"] == "codes"
    pinned = Schedule((0,), auto=True)
    pinned.pin({"policy": "codes"})
    steps(pinned, 3 * DRIFT_WINDOW, 0.1)
    assert pinned.entries("b")[2] == UNMEASURED
    pinned.agreed("b", drift(1.0))
    steps(pinned, 1, 0.3)
    assert pinned.report()[-1]["chosen"] == "codes"


def test_the_longest_drift_window_still_weighs_before_the_thousand_step_recheck(monkeypatch):
    """A drift window backed off to MAX_DRIFT_WINDOW settles, then weighs the next one against
    it well before RECHECK_STEPS: a watch whose second window closed with the re-check would
    never fire."""
    import types
    from hvd_aps import _schedule
    from hvd_aps._schedule import MAX_DRIFT_WINDOW, RECHECK_STEPS, UNMEASURED, Schedule, trial_steps
    now = [0.0]
    monkeypatch.setattr(_schedule, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    schedule = Schedule((0,), auto=True)
    schedule.candidate("b")
    _commits(schedule, trial_steps(("codes", "float32")))
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 0.5, 1.0, UNMEASURED, UNMEASURED])  # codes faster
    schedule.commit()
    state = schedule.state_dict()
    state["(policy)"]["drift"]["steps"] = MAX_DRIFT_WINDOW  # as after re-checks the drift started
    schedule.load_state_dict(state)
    schedule.commit()  # the step begun before the load is not timed
    for seconds in (0.1, 0.3):  # settled, then three times as slow
        for _ in range(MAX_DRIFT_WINDOW):
            now[0] += seconds
            schedule.commit()
    assert schedule.state_dict()["(policy)"]["since"] < RECHECK_STEPS
    assert schedule.entries("b")[2] == pytest.approx(2.0)
    schedule.agreed("b", schedule.entries("b"))
    schedule.commit()
    assert schedule.report()[-1]["chosen"] is None  # timed again, by the drift


def test_the_report_gives_the_agreed_medians_behind_a_decision():
    """After the trials decide, the report shows the medians every rank decided from (the
    slowest rank's), alike on every rank and after a resume, not this rank's own."""
    from hvd_aps._schedule import UNMEASURED, Schedule, trial_steps
    schedule = Schedule((0,), auto=True)
    schedule.candidate("b")
    _commits(schedule, trial_steps(("codes", "float32")))
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 0.5, 1.0, UNMEASURED, UNMEASURED])
    schedule.commit()
    resumed = Schedule((0,), auto=True)
    resumed.load_state_dict(schedule.state_dict())
    for run in (schedule, resumed):
        assert run.report()[-1]["chosen"] == "codes"
        assert run.report()[-1]["seconds"] == {"codes step": 0.5, "native float32 step": 1.0}


def test_pinned_decisions_survive_a_change_of_world():
    """reset() (Horovod elastic's world change) drops what was measured, not what pin() gave: a
    rank joining with the same pins must meet the survivors on the same path."""
    from hvd_aps._schedule import NATIVE, Schedule
    pinned = Schedule((0, 1 << 20), auto=True)
    pinned.pin({"chunk_bytes": {"b": 1 << 20}, "policy": "native"})
    measured = Schedule((0, 1 << 20), auto=True)
    measured.pin({"chunk_bytes": {"b": 1 << 20}})
    for run in (pinned, measured):
        run.reset()
    assert pinned.native_dtype() == "float32" and pinned.candidate("b") == NATIVE
    assert measured.native_dtype() is None and measured.candidate("b") == 1 << 20
    assert measured.decisions() == {"chunk_bytes": {"b": 1 << 20}, "policy": None}  # the policy timed afresh


def test_a_checkpoint_deciding_a_dtype_this_compressor_does_not_send_is_timed_afresh(caplog):
    """A decision for float16 loaded where the fallback is float32 alone is not sent: every path
    is timed again, with one warning; a codes decision (or none yet) from that checkpoint loads,
    its float16 steps only reported."""
    from hvd_aps._schedule import UNMEASURED, trial_steps

    def compressor(**options):
        return hvd_aps.APSCompressor("e4m3", policy="auto", chunk_bytes=0, stats=False, **options)

    def decided(medians):
        either = compressor(fallback="auto")
        either.state.schedule.candidate("b")
        _commits(either.state.schedule, trial_steps(("codes", "float32", "float16")))
        either.state.schedule.agreed("b", [UNMEASURED, UNMEASURED, *medians, UNMEASURED])
        either.state.schedule.commit()
        return either.state_dict()

    float32_only = compressor()
    with caplog.at_level("WARNING", logger="hvd_aps"):
        float32_only.load_state_dict(decided([2.0, 1.0, 0.5]))  # float16 kept
    assert float32_only.state.schedule.native_dtype() is None and float32_only.decisions()["policy"] is None
    assert caplog.text.count("does not") == 1  # the load checked first, then taken: said once
    float32_only.load_state_dict(decided([0.5, 1.0, 2.0]))  # codes kept
    assert float32_only.decisions()["policy"] == "codes"
    undecided = compressor(fallback="auto")
    undecided.state.schedule.candidate("b")
    float32_only.load_state_dict(undecided.state_dict())
    assert float32_only.state.schedule.state_dict()["(policy)"]["phase"] == "chunking"


def test_pins_stand_where_a_loaded_checkpoint_decided_nothing_and_travel_in_a_pickle():
    """pin() then load_state_dict(): what the checkpoint decided stands, its undecided parts take
    the pins (a chunking of a bucket it never met, the policy of a run still trying); a pickled
    state keeps the pins for a later reset()."""
    import pickle
    from hvd_aps._schedule import Schedule
    undecided = Schedule((0, 1 << 20), auto=True)
    undecided.candidate("b")
    pinned = Schedule((0, 1 << 20), auto=True)
    pinned.pin({"chunk_bytes": {"b": 1 << 20}, "policy": "native"})
    pinned.load_state_dict(undecided.state_dict())
    assert pinned.decisions() == {"chunk_bytes": {"b": 1 << 20}, "policy": "native", "native_dtype": "float32"}
    decided = Schedule((0, 1 << 20), auto=True)
    decided.pin({"chunk_bytes": {"b": 0}, "policy": "codes"})
    pinned.load_state_dict(decided.state_dict())
    assert pinned.decisions() == {"chunk_bytes": {"b": 0}, "policy": "codes"}
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    comp.pin({"policy": "native"})
    state = pickle.loads(pickle.dumps(comp.state))
    state.schedule.reset()
    assert state.schedule.native_dtype() == "float32"


def test_a_checkpoints_drift_window_is_held_to_the_longest_this_release_weighs():
    from hvd_aps._schedule import MAX_DRIFT_WINDOW, _Drift
    assert _Drift.load({"steps": 2 * MAX_DRIFT_WINDOW}).steps == MAX_DRIFT_WINDOW
    assert _Drift.load({"steps": 100}).steps == 100


def test_max_trial_steps_bounds_a_prediction_that_could_not_settle():
    """With a link, a prediction within PRIOR_MARGIN agrees on a step of its own, then the trials
    go on; with every round close, the decision still comes within max_trial_steps()."""
    from hvd_aps._schedule import Phase, _Policy, max_trial_steps
    policy = _Policy((Path.FLOAT32,))
    policy.step_ended(0.1, True, lambda: None)  # the chunking fixed: the trials begin
    steps = 0
    while policy.phase is not Phase.DECIDED:
        if policy.phase is Phase.DECIDING:  # the step's metadata agrees every rank's figures
            policy.medians = {Path.CODES: 0.1, Path.FLOAT32: 0.1}
        policy.step_ended(0.1, True, lambda: {Path.FLOAT32: 0.1})
        steps += 1
    assert policy.rounds == 3 and steps <= max_trial_steps()


def test_fallback_auto_times_float32_and_float16_and_keeps_the_faster():
    """fallback="auto": the trial blocks alternate codes, float32 and float16 steps, the three
    medians ride on the metadata, and the fastest path is kept."""
    from hvd_aps._schedule import STEP_TRIALS, UNMEASURED, trial_order, trial_steps
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", fallback="auto", chunk_bytes=0, stats=False)
    schedule = comp.state.schedule
    assert schedule.natives == ("float32", "float16") and schedule.candidate("b") == 0
    schedule.commit()
    paths = ("codes", "float32", "float16")
    assert _commits(schedule, trial_steps(paths)) == _blocks(trial_order(paths))
    assert [len(v) for v in schedule.state_dict()["(policy)"]["steps"].values()] == [STEP_TRIALS] * 3
    assert all(v > 0 for v in schedule.entries("b")[2:5]) and schedule.entries("b")[5] == UNMEASURED
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 2.0, 1.0, 0.5, UNMEASURED])
    schedule.commit()
    assert schedule.native_dtype() == "float16"
    assert comp.decisions() == {"chunk_bytes": {"b": 0}, "policy": "native", "native_dtype": "float16"}
    assert set(comp.schedule_report()[-1]["seconds"]) == {"codes step", "native float32 step", "native float16 step"}


def test_decisions_pin_a_later_run_without_trials():
    """An auto run's decisions, pinned in a fresh compressor, take effect from its first exchange:
    the pinned chunking without trying the others, the pinned policy without trial steps."""
    from hvd_aps._schedule import NATIVE
    fresh = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    assert fresh.decisions() == {"chunk_bytes": {}, "policy": None}
    assert fresh.state.schedule.candidate("b") == 0  # untuned: the warm-up, then every chunking
    comp = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    comp.pin({"chunk_bytes": {"b": 1 << 20}, "policy": "codes"})
    assert comp.state.schedule.candidate("b") == 1 << 20 and comp.state.schedule.native_dtype() is None
    assert comp.decisions() == {"chunk_bytes": {"b": 1 << 20}, "policy": "codes"}
    native = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    native.pin({"policy": "native"})
    assert native.state.schedule.candidate("other") == NATIVE
    again = hvd_aps.APSCompressor("e4m3", policy="auto", stats=False)
    again.pin(native.decisions())
    assert again.state.schedule.native_dtype() == "float32"
    assert native.decisions() == {"chunk_bytes": {}, "policy": "native", "native_dtype": "float32"}
    either = hvd_aps.APSCompressor("e4m3", policy="auto", fallback="auto", stats=False)
    either.pin({"policy": "native", "native_dtype": "float16"})
    assert either.state.schedule.native_dtype() == "float16"
    with pytest.raises(ValueError, match="native_dtype must be one of"):
        native.pin({"policy": "native", "native_dtype": "float16"})  # its fallback is float32
    with pytest.raises(ValueError, match="policy='auto'"):
        hvd_aps.APSCompressor("e4m3").pin({"policy": "native"})
    for bad in ({"policy": "fast"}, {"chunk_bytes": {"b": -1}}, {"chunk_bytes": {"b": "4MiB"}}, {"chunks": {}}):
        with pytest.raises(ValueError):
            comp.pin(bad)



@pytest.mark.parametrize("medians, chosen", [
    ({"codes": 0.90, "float32": 1.0}, "codes"), ({"codes": 0.97, "float32": 1.0}, "float32"),
    ({"codes": 1.10, "float32": 1.0}, "float32"),
    ({"codes": 2.0, "float32": 1.0, "float16": 0.97}, "float32"),  # float16 within CODES_MARGIN: float32
    ({"codes": 2.0, "float32": 1.0, "float16": 0.90}, "float16"),
    ({"codes": 0.93, "float32": 1.0, "float16": 0.96}, "float16"),  # codes within CODES_MARGIN of float16
    ({"codes": 0.80, "float32": 1.0, "float16": 0.96}, "codes")])
def test_policy_auto_keeps_a_less_exact_path_only_where_it_is_clearly_faster(medians, chosen):
    """After the last round, a path is kept over a more exact one (float32, then 16-bit, then
    codes) only where its median beats the more exact one's by CODES_MARGIN (5 %): closer than
    that, noisy steps cannot tell them apart, and the more exact path is never slower than itself."""
    from hvd_aps._schedule import ROUNDS, Schedule
    schedule = Schedule((0,), auto=True, natives=tuple(k for k in ("float32", "float16") if k in medians))
    schedule._policy.rounds = ROUNDS
    schedule._policy.decide(by_path(medians))
    assert schedule.state_dict()["(policy)"]["chosen"] == chosen


def test_policy_auto_runs_another_round_on_a_close_call():
    """The two fastest medians within CLEAR_MARGIN start another round of trial blocks (its steps
    pooled with the first round's, the round counted in the state_dict); clear margins decide at
    once."""
    from hvd_aps._schedule import CLEAR_MARGIN, STEP_TRIALS, UNMEASURED, Schedule, trial_order, trial_steps
    for codes, chosen in ((1 - 2 * CLEAR_MARGIN, "codes"), (1 + 2 * CLEAR_MARGIN, "native float32")):
        clear = Schedule((0,), auto=True)
        clear._policy.decide({Path.CODES: codes, Path.FLOAT32: 1.0})
        assert clear.report()[-1]["chosen"] == chosen
    schedule = Schedule((0,), auto=True)
    schedule.candidate("b")
    schedule.commit()
    paths = ("codes", "float32")
    _commits(schedule, trial_steps(paths) - 1)
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 0.95, 1.0, UNMEASURED, UNMEASURED])  # codes 5 % faster: close
    schedule.commit()
    assert schedule.report()[-1]["chosen"] is None and schedule.state_dict()["(policy)"]["rounds"] == 2
    assert _commits(schedule, trial_steps(paths) - 1) == _blocks(trial_order(paths))[:-1]
    assert [len(v) for v in schedule.state_dict()["(policy)"]["steps"].values()] == [2 * STEP_TRIALS] * 2
    schedule.agreed("b", [UNMEASURED, UNMEASURED, 0.5, 1.0, UNMEASURED, UNMEASURED])
    schedule.commit()
    assert schedule.report()[-1]["chosen"] == "codes"


@pytest.mark.parametrize("predicted, natives, left", [
    ({"codes": 1.0, "float32": 1.2}, ("float32",), ("codes", "float32")),
    ({"codes": 1.2, "float32": 1.0}, ("float32",), ("codes", "float32")),
    ({"codes": 1.0, "float32": 1.3}, ("float32",), ("codes",)),
    ({"codes": 1.3, "float32": 1.0}, ("float32",), ("float32",)),
    # a 16-bit prediction is a lower bound: it drops float16, never the others
    ({"codes": 1.0, "float32": 2.0, "float16": 1.5}, ("float32", "float16"), ("codes",)),
    ({"codes": 1.0, "float32": 2.0, "float16": 0.5}, ("float32", "float16"), ("codes", "float16")),
    ({"codes": 2.0, "float32": 1.0, "float16": 0.6}, ("float32", "float16"), ("float32", "float16")),
    ({"codes": 1.0, "float16": 0.5}, ("float16",), ("codes", "float16"))])
def test_a_predicted_margin_past_prior_margin_drops_a_path_and_the_rest_are_timed(predicted, natives, left):
    from hvd_aps._schedule import CODES, Schedule, trial_order
    schedule = Schedule((0,), auto=True, natives=natives)
    schedule._policy.predicting = by_path(predicted)  # this rank's; the agreed ones decide
    schedule._policy.decide(by_path(predicted))
    policy = schedule.state_dict()["(policy)"]
    assert policy["phase"] == ("trials" if len(left) > 1 else "decided")
    assert policy["prediction"] == predicted
    if len(left) == 1:
        assert policy["chosen"] == left[0]
    else:  # every path left gets its blocks, the codes block already timed not again
        order = list(trial_order(left))
        if CODES in order:
            order.remove(CODES)
        assert policy["order"] == order and policy["chosen"] is None


def test_the_prediction_places_each_allreduce_on_the_codes_steps_timeline():
    """The framework's step is predicted on the codes steps' own timeline: each bucket's
    allreduce starts where its codes exchange started after the step began, or where the one
    before it ends, and the step goes on after the last as long as the codes steps did."""
    from hvd_aps._schedule import BLOCK_STEPS, _Timeline
    timeline = _Timeline()
    timeline.committed(None, 10.0, record=False)  # the first step begins
    for k in range(BLOCK_STEPS):
        began = 10.0 + k
        timeline.placed("a", began + 0.1, began + 0.5)
        timeline.placed("b", began + 0.3, began + 0.6)
        timeline.committed(began, began + 1.0, record=True)
    assert timeline.step_with({"a": 0.05, "b": 0.05}) == pytest.approx(0.3 + 0.05 + 0.4)
    assert timeline.step_with({"a": 0.5, "b": 0.1}) == pytest.approx(0.1 + 0.5 + 0.1 + 0.4)  # b waits for a
    assert timeline.step_with({"a": 0.1, "c": 0.1}) is None  # c never placed
    timeline.rolled_back()
    timeline.placed("a", 20.1, 20.2)
    timeline.committed(None, 21.0, record=True)  # began unknown after a rollback (the schedule's clock): not recorded
    assert timeline.step_with({"a": 0.05, "b": 0.05}) == pytest.approx(0.3 + 0.05 + 0.4)


def test_an_earlier_release_policy_state_reads_as_float32():
    """A state_dict whose policy named the fixed fallback "native" resumes on the first native."""
    from hvd_aps._schedule import Schedule
    schedule = Schedule((0,), auto=True)
    schedule.load_state_dict({"(policy)": {"phase": "decided", "chosen": "native", "block": 4, "timed": 0,
                                           "rounds": 1, "steps": {"codes": [1.0], "native": [0.5]},
                                           "predicting": None, "prediction": [1.0, 0.5]}})
    assert schedule.native_dtype() == "float32"
    assert schedule.state_dict()["(policy)"]["prediction"] == {"codes": 1.0, "float32": 0.5}
    assert schedule.state_dict()["(policy)"]["steps"] == {"codes": [1.0], "float32": [0.5]}


def test_values_seed_moves_on_when_the_sum_comes_back():
    """wire="values": a tensor's stochastic seed is drawn from its count of sums that came back,
    so a compress() whose allreduce never returned rounds again with the same seed."""
    comp = hvd_aps.APSCompressor("e4m3", wire="values", rounding="stochastic", seed=3, stats=False)
    first = comp.state.values_seed(0, "grad.w")
    assert comp.state.values_seed(0, "grad.w") == first  # compressed again: the step did not finish
    assert comp.state.values_seed(1, "grad.w") != first and comp.state.values_seed(0, "grad.b") != first
    comp.state.values_done("grad.w")
    second = comp.state.values_seed(0, "grad.w")
    assert second != first
    resumed = hvd_aps.APSCompressor("e4m3", wire="values", rounding="stochastic", seed=3, stats=False)
    resumed.load_state_dict(comp.state_dict())
    assert resumed.state.values_seed(0, "grad.w") == second


def test_job_link_reads_a_rate_or_a_calibration_file(monkeypatch, tmp_path):
    from hvd_aps import calibration, perf
    monkeypatch.delenv(calibration.LINK_ENV, raising=False)
    assert calibration.job_link() is None
    monkeypatch.setenv(calibration.LINK_ENV, "10gbit")
    assert calibration.job_link() == perf.Link(10e9 / 8)
    cal = tmp_path / "cal.json"
    calibration.add_links(cal, calibration.links_entry(perf.Link(1e8, 3e-5), perf.Cluster(2, perf.Link(1e8)), []))
    monkeypatch.setenv(calibration.LINK_ENV, str(cal))
    assert calibration.job_link() == perf.Link(1e8, 3e-5)
    assert hvd_aps.APSCompressor("e4m3", policy="auto").state.schedule.link == perf.Link(1e8, 3e-5)
    assert hvd_aps.APSCompressor("e4m3").state.schedule.link == perf.Link(1e8, 3e-5)  # policy="codes" warns
    empty = tmp_path / "empty.json"
    empty.write_text('{"format": "calibration/1"}')
    for bad, message in ((str(empty), "holds no link"), ("fast", "a link rate")):
        monkeypatch.setenv(calibration.LINK_ENV, bad)
        with pytest.raises(ValueError, match=message):
            calibration.job_link()


def stepped(fmt="e2m1fn", **options):
    """A compressor whose state holds one residual and one step."""
    comp = hvd_aps.APSCompressor(fmt, error_feedback=True, seed=3, chunk_bytes=0, **options)
    comp.state.residuals.next(("t", "send", 0), 4, np).fill(0.5)
    comp.state.exchanged(["t"])
    comp.state.commit()
    return comp


def test_a_state_of_other_settings_is_refused_by_name_and_changes_nothing():
    saved, comp = stepped("e2m1fn").state_dict(), stepped("e4m3")
    before = comp.state_dict()
    with pytest.raises(ValueError, match="saved by an APSCompressor with fmt=e2m1fn where this one has fmt=e4m3"):
        comp.load_state_dict(saved)
    assert comp.state_dict()["settings"] == before["settings"] and comp.state_dict()["steps"] == {"t": 1}
    chunked = stepped("e2m1fn", bucket_bytes=1 << 20)  # scheduling settings may change between runs
    chunked.load_state_dict(saved)
    assert (chunked.state_dict()["residuals"]["t|send|0"] == 0.5).all()


@pytest.mark.parametrize("corrupt", [lambda s: s.pop("steps"), lambda s: s.update(seed="three"),
                                     lambda s: s["residuals"].update({"no key": np.ones(2)}),
                                     lambda s: s.update(schedule=[1, 2])])
def test_a_corrupted_state_is_refused_and_changes_nothing(corrupt):
    saved = stepped().state_dict()
    corrupt(saved)
    comp = hvd_aps.APSCompressor("e2m1fn", error_feedback=True, seed=9, chunk_bytes=0)
    with pytest.raises(ValueError, match="not a state_dict this APSCompressor can load"):
        comp.load_state_dict(saved)
    assert comp.seed == 9 and comp.state_dict()["residuals"] == {}
    with pytest.raises(TypeError, match="load_state_dict takes what APSCompressor.state_dict"):
        comp.load_state_dict([saved])


def test_autograph_runs_the_tf_entry_points_as_plain_python():
    """Inside a tf.function AutoGraph converts what a converted function calls unless it is marked
    (tf.autograph.experimental.do_not_convert's mark); converted, the compressor's code broke."""
    pytest.importorskip("tensorflow")
    import hvd_aps.tensorflow
    from tensorflow.python.autograph.impl import api
    comp = hvd_aps.APSCompressor("e4m3")
    for entry in (comp.compress, comp.decompress, hvd_aps.tensorflow.allreduce_codes):
        assert api.is_autograph_artifact(entry), entry
