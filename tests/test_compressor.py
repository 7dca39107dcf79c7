"""APSCompressor's framework-neutral numerics, called directly (no Horovod processes)."""
import numpy as np
import pytest

import hvd_aps
from hvd_aps.compressor import from_name


def test_to_wire_is_the_scaled_grid_in_float16_and_from_wire_undoes_the_shift():
    comp = hvd_aps.APSCompressor("e4m3")
    x = np.random.default_rng(0).normal(0, 1e-4, 1000).astype(np.float32)
    wire, shift = comp.to_wire(x, float(np.abs(x).max()), 4, 0, "g")
    assert wire.dtype == np.float16 and shift == hvd_aps.scaling.shift_for(float(np.abs(x).max()), 4, "e4m3", 65504.0)
    assert (wire.astype(np.float32) == hvd_aps.quantize(x, "e4m3", shift=shift, unscale=False)).all()
    assert (comp.from_wire(wire, shift) == hvd_aps.quantize(x, "e4m3", shift=shift)).all()
    assert hvd_aps.APSCompressor("e6m2").carrier == np.float32  # beyond float16's range: float32 carries it


def test_stats_and_totals():
    comp = hvd_aps.APSCompressor("e4m3", scaling=None)
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
                for s in ("aps", None) for t in (False, True)]
    assert len({c.signature for c in variants}) == len(variants)
    comp = variants[0]
    agreed = np.maximum(comp.metadata(0.5), variants[5].metadata(0.25))
    with pytest.raises(ValueError, match="mismatch across ranks"):
        comp.check_agreed(agreed)
    assert comp.check_agreed(np.maximum(comp.metadata(0.5), comp.metadata(0.25))) == 0.5


def test_constructor_and_names():
    with pytest.raises(ValueError, match="rounding"):
        hvd_aps.APSCompressor("e4m3", rounding="up")
    with pytest.raises(ValueError, match="scaling"):
        hvd_aps.APSCompressor("e4m3", scaling="local")

    class Stock:
        none, fp16 = "stock-none", "stock-fp16"

    assert from_name("fp16", Stock) == "stock-fp16"
    assert from_name("naive-e5m2", Stock).scaling is None and from_name("aps-e3m0", Stock).fmt == hvd_aps.e3m0
    with pytest.raises(ValueError, match="unknown compression"):
        from_name("zip", Stock)
    assert hvd_aps.APSCompressor("e4m3").compress([1, 2]) == ([1, 2], None)  # not a tensor: passed through
