"""APSCompressor and the Keras 3 wrapper under real `horovodrun -np 2 --gloo` processes."""
import ml_dtypes
import numpy as np
import pytest

import model
from horovod_run import horovodrun, load
from support import tensorboard_scalars
from workers.common import CODES_SIZES, codes_grads
from workers.common import KERAS_LR, KERAS_W0, keras_data, rank_data


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tf")
    return horovodrun("tensorflow_checks.py", tmp), load(tmp, "tf"), tmp


@pytest.fixture(scope="module")
def ranks(run):
    return run[1]


def test_autograph_converts_every_call_it_traces(run):
    """The compressor's calls inside tf.function (Horovod's graph, the tape, Keras) are ones
    autograph converts: nothing warns on the user's console that it could not."""
    assert "AutoGraph could not transform" not in run[0].stderr + run[0].stdout


def test_allreduce_sends_codes_bit_exact_eager_and_in_a_graph(ranks):
    want = model.flat([[rank_data(0)], [rank_data(1)]], "e4m3")[0]
    for r in ranks:
        assert r["avg_eager"].tobytes() == want.tobytes()
        assert r["avg_graph"].tobytes() == want.tobytes()


def test_grouped_sum_in_a_graph_is_bit_exact(ranks):
    grads = [codes_grads(r) for r in range(2)]
    big = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]  # compressed in one batch, in order
    want = dict(zip(big, model.flat([[g[i].ravel() for i in big] for g in grads], "e4m3", average=False)))
    for r in ranks:
        for i in big:
            assert r[f"grouped_sum_{i}"].tobytes() == want[i].reshape(CODES_SIZES[i]).tobytes(), i


def test_values_wire_is_bit_exact_eager_and_in_a_graph(ranks):
    want, _ = model.stock_reference([rank_data(0), rank_data(1)], ml_dtypes.float8_e4m3, "e4m3")
    for r in ranks:
        assert r["values_eager"].tobytes() == want.tobytes() and r["values_graph"].tobytes() == want.tobytes()


def test_naive_zeros_nan_dtype_and_a_single_variable(ranks):
    for r in ranks:
        assert (r["naive"] == 0).all() and (r["zeros"] == 0).all()
        assert np.isnan(r["nan"]).all()
        assert bool(r["f16_dtype_ok"])
        assert (r["single_variable"] == 1.5).all()
        assert r["one_by_one_warned"].tolist() == [False, True]  # Horovod's tape without num_groups=1


def test_policy_auto_sends_the_tapes_buckets_through_horovods_allreduce(ranks):
    """Pinned to the framework's path, the bucket is Horovod's sum of both ranks' values in the
    fallback dtype, averaged in float32; a bfloat16 fallback is refused before anything is sent."""
    x = [rank_data(r, seed=9) for r in range(2)]
    for fallback in ("float32", "float16"):
        total = (x[0].astype(fallback) + x[1].astype(fallback)).astype(np.float32)
        for r in ranks:
            assert r[f"tape_native_{fallback}"].tobytes() == (total / np.float32(2)).tobytes(), fallback
            assert int(r[f"tape_native_{fallback}_bytes"]) == np.dtype(fallback).itemsize * x[0].size  # 2(N-1)/N = 1
    for r in ranks:
        assert bool(r["tape_bfloat16_refused"]) and bool(r["line_bfloat16_refused"])


@pytest.mark.parametrize("key", ["tape_graph", "tape_eager", "v1_optimizer", "keras_codes", "tape_codes_graph",
                                 "keras_values"])
def test_training_leaves_parameters_bit_identical(ranks, key):
    assert ranks[0][key].tobytes() == ranks[1][key].tobytes()
    assert np.isfinite(ranks[0][key]).all()


def keras_reference():
    """One SGD step of the MSE loss on both ranks' data concatenated, from rank 0's weights."""
    x = np.concatenate([keras_data(0)[0], keras_data(1)[0]]).astype(np.float64)
    y = np.concatenate([keras_data(0)[1], keras_data(1)[1]]).astype(np.float64)
    w, b = KERAS_W0.astype(np.float64), 0.0
    err = x @ w + b - y
    grad_w, grad_b = 2 * x.T @ err / len(x), 2 * err.mean()
    return np.concatenate([(w - KERAS_LR * grad_w).ravel(), [b - KERAS_LR * grad_b]])


def test_keras3_wrapper_averages_like_one_process_on_all_data(ranks):
    want = keras_reference()
    for r in ranks:
        assert np.allclose(r["keras_none"], want, rtol=1e-5, atol=1e-6)
    update = np.abs(want - np.append(KERAS_W0.ravel(), 0.0))
    assert (np.abs(ranks[0]["keras_values"] - want) <= 0.07 * update + 1e-6).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("path", ["grouped", "codes"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients_come_back_in_their_dtype(ranks, path, dtype):
    """bfloat16 and float16 gradients through Horovod's grouped allreduce with the compressor and
    through the codes path: codes from their values, the average rounded back to their dtype, bit
    for bit as the model; tensors too small for codes through Horovod's allreduce (the compressor
    hands them over in float32, as its tokens; the codes path in their dtype, bfloat16, which
    Horovod refuses, in float32) within the dtype's roundings of the float64 average."""
    grads = [[model.held_in(g, dtype) for g in codes_grads(r)] for r in range(2)]
    big = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]
    order = big if path == "grouped" else big[::-1]  # one batch in call order; one bucket in reverse
    want = dict(zip(order, model.flat([[g[i].ravel() for i in order] for g in grads], "e4m3")))
    assert model.low_precision_mismatches(ranks, f"{path}_{dtype}", grads, want, dtype, CODES_SIZES) == []


def test_keras_mixed_precision_scales_the_loss_after_the_allreduce(ranks):
    """mixed_float16 through the wrapper (loss scaling inside it): ranks train alike; when only
    rank 1's scaled gradients overflow, every rank skips the steps (weights stay rank 0's) and
    halves its loss scale."""
    start = np.append(KERAS_W0.ravel(), 0.0).astype(np.float32)
    for r in ranks:
        assert bool(r["mixed_finite_wrapped"]) and bool(r["mixed_overflow_wrapped"])
        assert r["mixed_finite"].tobytes() == ranks[0]["mixed_finite"].tobytes() and np.isfinite(r["mixed_finite"]).all()
        assert float(r["mixed_finite_scale"]) == 2.0 ** 15
        assert r["mixed_overflow"].tobytes() == start.tobytes() and float(r["mixed_overflow_scale"]) == 2.0 ** 13
    assert not np.array_equal(ranks[0]["mixed_finite"], start)


def test_format_mismatch_fails_on_every_rank(ranks):
    """TF's stages run in tf.numpy_function, where the ranks cannot gather their settings: each
    rank's error gives its own settings other than the defaults."""
    for rank, r in enumerate(ranks):
        assert str(r["mismatch"]).startswith("APSCompressor settings differ between ranks")
        assert f"this rank's, where not the defaults: fmt={'e4m3' if rank == 0 else 'e5m2'}, min_elements=16." in str(
            r["mismatch"])


@pytest.mark.parametrize("key, fmt", [("codes_e4m3", "e4m3"), ("codes_e2m1fn", "e2m1fn"), ("codes_graph", "e4m3")])
def test_codes_path_equals_the_numpy_model(ranks, key, fmt):
    big = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]
    grads = [codes_grads(r) for r in range(2)]
    want = dict(zip(big[::-1], model.flat([[g[i].ravel() for i in big[::-1]] for g in grads], fmt)))
    for r in ranks:
        for i in big:
            assert r[f"{key}_{i}"].tobytes() == want[i].reshape(CODES_SIZES[i]).tobytes(), (key, i)


def test_chunked_codes_in_a_graph_equal_the_model_cut_alike(ranks):
    big = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16][::-1]  # bucket order
    grads = [[codes_grads(r)[i].ravel() for i in big] for r in range(2)]
    want = dict(zip(big, model.flat(grads, "e4m3")))  # chunks change the collectives, not the numbers
    for r in ranks:
        for i in big:
            assert r[f"codes_chunked_{i}"].tobytes() == want[i].reshape(CODES_SIZES[i]).tobytes(), i


def test_codes_path_non_finite_stays_visible(ranks):
    for r in ranks:
        assert np.isnan(r["codes_nan"]).all()


def test_keras_codes_close_to_one_process(ranks):
    want = keras_reference()
    update = np.abs(want - np.append(KERAS_W0.ravel(), 0.0))
    assert (np.abs(ranks[0]["keras_codes"] - want) <= 0.07 * update + 1e-6).all()


def test_horovods_tf2_api_takes_keras3_models(ranks):
    """broadcast_variables(model.variables) and DistributedGradientTape on Keras 3 variables (the
    installer patches Horovod for them): every rank starts from rank 0's weights and trains alike."""
    for key in ("keras3_broadcast", "keras3_tape"):
        assert ranks[0][key].tobytes() == ranks[1][key].tobytes() and np.isfinite(ranks[0][key]).all()
    assert not np.array_equal(ranks[0]["keras3_broadcast"], ranks[0]["keras3_tape"])


def test_keras_fit_writes_the_fidelity_to_tensorboard_on_rank_zero(run):
    """hvd_aps.keras.FidelityLogger in model.fit: TensorBoard event files (read back with
    TensorBoard's own reader) hold the step's relative error, flushed and saturated shares, bytes
    sent and the APS shift on rank 0, and nothing on rank 1."""
    folder = run[2]
    logs, other = (tensorboard_scalars(folder / "tb_keras" / f"rank{r}") for r in range(2))
    assert not other
    for tag in ("relative_error", "flushed", "saturated", "bytes_sent"):
        assert [step for step, _ in logs[f"hvd_aps/{tag}"]] == [1], (tag, sorted(logs))
    assert logs["hvd_aps/bytes_sent"][0][1] > 0 and any(tag.startswith("hvd_aps/shift/") for tag in logs)
