"""APSCompressor under real `horovodrun -np 2 --gloo` processes with horovod.torch."""
import ml_dtypes
import numpy as np
import pytest

from hvd_aps import scaling
from horovod_run import horovodrun, load
from workers.common import poisoned, rank_data


def stock_reference(arrays, fmt_dtype, fmt, average=True):
    """The stock path in NumPy: agreed shift (headroom for a float16 sum), ml_dtypes rounding,
    float16 sum, Horovod's 1/N postscale in float16, unscale."""
    n = len(arrays)
    s = scaling.shift_for(max(float(np.abs(a).max()) for a in arrays), n, fmt, sum_max=65504.0)
    terms = [np.ldexp(a, s).astype(fmt_dtype).astype(np.float16) for a in arrays]
    total = terms[0]
    for t in terms[1:]:
        total = (total + t).astype(np.float16)
    if average:
        total = (total.astype(np.float32) * np.float32(1 / n)).astype(np.float16)
    return np.ldexp(total.astype(np.float32), -s).astype(np.float32), s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    horovodrun("torch_checks.py", tmp)
    return load(tmp, "torch")


def same_on_all_ranks(ranks, key):
    a, b = ranks[0][key], ranks[1][key]
    return a.tobytes() == b.tobytes()


def test_average_is_bit_exact_to_a_numpy_reference(ranks):
    want, s = stock_reference([rank_data(0), rank_data(1)], ml_dtypes.float8_e4m3, "e4m3")
    assert same_on_all_ranks(ranks, "avg")
    assert int(ranks[0]["avg_shift"]) == s
    assert ranks[0]["avg"].tobytes() == want.tobytes()


def test_sum_is_bit_exact_to_a_numpy_reference(ranks):
    arrays = [rank_data(r, sigma=3.0, seed=1) for r in range(2)]
    want, _ = stock_reference(arrays, ml_dtypes.float8_e5m2, "e5m2", average=False)
    assert same_on_all_ranks(ranks, "sum_e5m2") and ranks[0]["sum_e5m2"].tobytes() == want.tobytes()


def test_aps_keeps_small_gradients_and_the_naive_cast_loses_them(ranks):
    exact = (rank_data(0).astype(np.float64) + rank_data(1)) / 2
    err = np.linalg.norm(ranks[0]["avg"] - exact) / np.linalg.norm(exact)
    assert err < 0.05
    assert (ranks[0]["naive"] == 0).all()  # sigma 1e-4 is below e4m3's smallest subnormal


def test_zeros_nan_inf(ranks):
    for r in ranks:
        assert (r["zeros"] == 0).all()
        for key in ("nan", "inf"):
            assert not np.isfinite(r[key][3]) and np.isfinite(np.delete(r[key], 3)).all()
        # a tensor with NaN/Inf goes unscaled in float16: its finite entries keep float16 accuracy
        exact = (poisoned(0, 0.0).astype(np.float64) + poisoned(1, 0.0)) / 2
        assert np.allclose(np.delete(r["nan"], 3), np.delete(exact, 3), rtol=0, atol=2 ** -21)
    assert ranks[0]["after"].tobytes() == ranks[0]["avg"].tobytes()  # nothing else corrupted


def test_dtypes_pass_through(ranks):
    assert bool(ranks[0]["bf16_dtype_ok"])
    assert ranks[0]["ints"].tolist() == [0, 3, 6, 9, 12]  # integers are not compressed


@pytest.mark.parametrize("key", ["params_avg", "params_sum_groups", "params_bpps_predivide"])
def test_training_leaves_parameters_bit_identical(ranks, key):
    assert same_on_all_ranks(ranks, key)
    assert np.isfinite(ranks[0][key]).all()


def test_format_mismatch_fails_on_every_rank(ranks):
    for r in ranks:
        assert "APSCompressor mismatch across ranks" in str(r["mismatch"])
