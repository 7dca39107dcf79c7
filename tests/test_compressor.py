"""APSCompressor's framework-neutral numerics, called directly (no Horovod processes)."""
import warnings

import numpy as np
import pytest

import hvd_aps
from hvd_aps import from_name, tokens


def test_to_wire_is_the_scaled_grid_in_float16_and_from_wire_undoes_the_shift():
    comp = hvd_aps.APSCompressor("e4m3")
    x = np.random.default_rng(0).normal(0, 1e-4, 1000).astype(np.float32)
    wire, shift = comp.to_wire(x, float(np.abs(x).max()), 4, 0, "g")
    assert wire.dtype == np.float16 and shift == hvd_aps.scaling.shift_for(float(np.abs(x).max()), 4, "e4m3", 65504.0)
    assert (wire.astype(np.float32) == hvd_aps.quantize(x, "e4m3", shift=shift, unscale=False)).all()
    assert (comp.from_wire(wire, shift) == hvd_aps.quantize(x, "e4m3", shift=shift)).all()
    assert hvd_aps.APSCompressor("e6m2").carrier == np.float32  # beyond float16's range: float32 carries it


def test_stats_and_totals():
    comp = hvd_aps.APSCompressor("e4m3", scaling="none")
    x = np.array([0.0, 1e-6, 1e-6, 1.0, 1000.0], np.float32)  # two flushed, one beyond max (240)
    comp.to_wire(x, 1000.0, 2, 0, "a")
    comp.to_wire(x[:4], 1.0, 2, 0, "b")
    a, total = comp.stats["a"], comp.totals()
    assert (a.nonzero, a.flushed_count, a.saturated, a.bytes_in, a.bytes_carried) == (4, 2, 1, 20, 10)
    assert (total.elements, total.nonzero, total.flushed_count, total.saturated) == (9, 7, 4, 1)
    assert total.flushed == pytest.approx(4 / 7) and "57.14% of nonzero values flushed" in str(total)
    comp.reset_stats()
    assert comp.totals().elements == 0 and comp.stats == {}


def test_non_finite_agreed_max_sends_the_tensor_unscaled():
    comp = hvd_aps.APSCompressor("e2m1fn")
    x = np.array([1e-3, 2.0, -3.0], np.float32)
    wire, shift = comp.to_wire(x, float("inf"), 2, 0, "g")
    assert shift == 0 and (wire == x.astype(np.float16)).all() and not comp.stats["g"].finite


def test_signature_distinguishes_every_option():
    variants = [hvd_aps.APSCompressor(f, rounding=r, scaling=s, saturate=t)
                for f in ("e4m3", "e4m3fn", "e5m2", "e3m0") for r in ("nearest", "stochastic")
                for s in ("aps", "none") for t in (False, True)]
    assert len({c.signature for c in variants}) == len(variants)
    comp = variants[0]
    agreed = np.maximum(comp.metadata([0.5], [3]), variants[5].metadata([0.25], [3]))
    with pytest.raises(ValueError, match="mismatch across ranks"):
        comp.agreed_amaxes(agreed, [3], ["g"])
    assert comp.agreed_amaxes(np.maximum(comp.metadata([0.5], [3]), comp.metadata([0.25], [3])), [3], ["g"]) == [0.5]
    with pytest.raises(ValueError, match=r"tensor 0 \(g\) has 3 elements here and 3 to 4"):
        comp.agreed_amaxes(np.maximum(comp.metadata([0.5], [3]), comp.metadata([0.5], [4])), [3], ["g"])


def test_configuration_is_validated_once_and_frozen():
    for kwargs, match in ((dict(rounding="up"), "rounding"), (dict(scaling=None), "scaling"),
                          (dict(wire="float16"), "wire"), (dict(bucket_bytes=-1), "bucket_bytes"),
                          (dict(min_elements=2.5), "min_elements")):
        with pytest.raises(ValueError, match=match):
            hvd_aps.APSCompressor("e4m3", **kwargs)
    with pytest.raises(TypeError, match="saturate"):
        hvd_aps.APSCompressor("e4m3", saturate="yes")
    config = hvd_aps.APSCompressor("e4m3").config
    assert config == hvd_aps.APSConfig(hvd_aps.e4m3) and config.bucket_bytes == 16 << 20
    with pytest.raises(Exception, match="frozen|assign"):
        config.rounding = "stochastic"


def test_names():
    class Stock:
        none, fp16 = "stock-none", "stock-fp16"

    assert from_name("fp16", Stock) == "stock-fp16"
    assert from_name("naive-e5m2", Stock).config.scaling == "none" and from_name("aps-e3m0", Stock).fmt == hvd_aps.e3m0
    assert from_name("aps-e4m3", Stock).config.wire == "codes" and from_name("aps-e4m3-values", Stock).config.wire == "values"
    assert from_name("codes-e2m1fn", Stock).config == hvd_aps.APSConfig("e2m1fn")
    for bad in ("zip", "aps-e4m3-fast", "aps"):
        with pytest.raises(ValueError, match="unknown compression"):
            from_name(bad, Stock)
    assert hvd_aps.APSCompressor("e4m3").compress([1, 2]) == ([1, 2], None)  # not a tensor: passed through


def test_token_value_says_what_horovod_did():
    total = np.array([3.0, -6.0], np.float32)
    tokens_of = [tokens.token_values(r) for r in range(3)]
    summed = np.sum(tokens_of, axis=0)
    assert (tokens.apply_op(total.copy(), summed * np.float32(0.33333334), 3) == total / np.float32(3)).all()  # Average
    assert (tokens.apply_op(total.copy(), summed, 3) == total).all()  # Sum
    assert (tokens.apply_op(total.copy(), summed * 0.5, 3) == total * np.float32(0.5)).all()  # a custom postscale
    adasum_of_two = np.array([1.25, 0.75])  # Adasum([1, 0], [1, 1])
    for not_a_sum, world in ((np.max(tokens_of, axis=0), 3), (np.min(tokens_of, axis=0), 3), (adasum_of_two, 2)):
        with pytest.raises(ValueError, match="wire='values'"):
            tokens.apply_op(total, not_a_sum, world)


def test_missing_host_engine_warns_once(monkeypatch):
    monkeypatch.setattr(hvd_aps.codec._host_engine, "available", False)
    monkeypatch.delenv("HVD_APS_ENGINE", raising=False)
    hvd_aps.codec._warn_numpy_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="host engine .* is not built"):
        assert hvd_aps.codec.engine_name() == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_aps.codec.engine_name()  # said once per process


def test_stats_measure_the_encode_error_on_both_wires():
    """relative_error = ||q(g) - g|| / ||g||, against quantize() computed here, for the values
    wire (to_wire) and for the codes wire (the exchange's record of what each rank encoded)."""
    x = np.random.default_rng(3).normal(0, 1e-3, (40, 50)).astype(np.float32)
    comp = hvd_aps.APSCompressor("e3m0", wire="values")
    _, shift = comp.to_wire(x, float(np.abs(x).max()), 2, 0, "w")
    sent = hvd_aps.quantize(x, "e3m0", shift=shift).astype(np.float64)
    want = np.linalg.norm(sent - x) / np.linalg.norm(x.astype(np.float64))
    assert comp.stats["w"].relative_error == pytest.approx(want, rel=1e-9) and want > 0.05

    codes_comp = hvd_aps.APSCompressor("e3m0")
    row = np.zeros(hvd_aps.codec.packed_size(x.size + 3, "e3m0"), np.uint8)  # the codes start mid-byte
    hvd_aps.codec.encode_into(x.ravel(), "e3m0", row, 3, shift=shift)
    codes_comp.record("c", codes_comp.measure_codes(x.ravel(), row, 3, shift, codes_comp.fmt))
    assert codes_comp.stats["c"].relative_error == pytest.approx(want, rel=1e-9)
    total = codes_comp.totals() + comp.totals()
    assert total.relative_error == pytest.approx(want, rel=1e-9)  # sums of squares add up
    table, csv = codes_comp.stats_table(), codes_comp.stats_table(csv=True)
    assert csv.splitlines()[0] == ("tensor,format,elements,measured,shift,flushed,saturated,relative_error,"
                                   "bytes_in,bytes_carried")
    assert csv.splitlines()[1].startswith(f"c,e3m0,2000,2000,{shift},") and f"{want:.4e}" in csv
    assert table.split()[:2] == ["tensor", "format"] and "relative encode error" in str(total)


def test_sampled_stats_estimate_the_whole_tensor():
    """Stats of a 4M-element tensor from the default strided sample: within a few per cent of
    every element's figures (a heavy-tailed tensor, so flushed and saturated counts are not 0)."""
    x = np.random.default_rng(4).laplace(0, 1e-3, 1 << 22).astype(np.float32)
    fmt, shift = hvd_aps.FloatFormat.parse("e3m0"), 11  # e3m0's max 16 at 2**11: |x| > 0.0078 saturates
    row = hvd_aps.pack(hvd_aps.encode(x, fmt, shift=shift, saturate=True), fmt)
    exact, sampled = hvd_aps.APSCompressor(fmt, stats_sample=0), hvd_aps.APSCompressor(fmt)
    for comp in (exact, sampled):
        comp.record("x", comp.measure_codes(x, row, 0, shift, fmt))
    e, s = exact.stats["x"], sampled.stats["x"]
    assert e.measured == x.size and 0.9 * 65536 <= s.measured <= 65536 and s.elements == x.size
    assert s.relative_error == pytest.approx(e.relative_error, rel=0.05) and e.relative_error > 0.1
    assert s.flushed == pytest.approx(e.flushed, rel=0.05) and e.flushed > 0.01
    assert s.saturated == pytest.approx(e.saturated, rel=0.2) and e.saturated > 100
    assert "sampled elements" in str(s) and "sampled" not in str(e)


def test_hybrid_configuration_is_checked_and_signed():
    with pytest.raises(ValueError, match="wider format than e4m3"):
        hvd_aps.APSCompressor("e4m3", hybrid="e3m0")
    with pytest.raises(ValueError, match="hybrid needs wire='codes'"):
        hvd_aps.APSCompressor("e3m0", wire="values", hybrid="e4m3")
    with pytest.raises(ValueError, match="hybrid_threshold"):
        hvd_aps.APSCompressor("e3m0", hybrid="e4m3", hybrid_threshold=0)
    signatures = {hvd_aps.APSCompressor("e3m0", hybrid=h, hybrid_threshold=t).signature
                  for h, t in ((None, 0.75), ("e4m3", 0.75), ("e5m2", 0.75), ("e4m3", 0.5))}
    assert len(signatures) == 4 and max(signatures) < 2 ** 53
    comp = hvd_aps.from_name("codes-e2m1fn-ef-hybrid", None)
    assert comp.config.error_feedback and str(comp.config.hybrid) == "e4m3"
