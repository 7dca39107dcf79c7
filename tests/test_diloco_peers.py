"""hvd_aps.diloco_peers: the outer exchanges of INTELLECT-1, torchft and Streaming DiLoCo, held to
their arithmetic written out here for one worker, where no ring order enters, and to what each
must keep for any number of workers."""
import ml_dtypes
import numpy as np
import pytest

from hvd_aps import diloco_peers as peers


def pseudo(n, shape=(64, 40), seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, -2)).astype(np.float32) for _ in range(n)]


def int8_round_trip(x):
    """uniform_8bit_quantize and its codebook's values, from the description."""
    sigma = np.sqrt((x.astype(np.float64) ** 2).sum() / (x.size - 1))
    scale = np.float32(6 * sigma / 256)
    scaled = (x / scale).astype(np.float64)  # std::round in exact arithmetic: |v| + 1/2 is exact in float64
    codes = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5) + 128, 0, 255).astype(int)
    book = np.array([x[codes == b].astype(np.float64).mean() if (codes == b).any() else 0.0 for b in range(256)],
                    np.float32)
    return book[codes]


def test_intellect1_rounds_halves_away_from_zero_as_std_round_does():
    """The float32 just below a half rounds to 0 (floor(v + 0.5) in float32 would give 1), a half
    to 1, minus a half to -1, and so on."""
    below = np.nextafter(np.float32(0.5), np.float32(0))
    v = np.array([below, 0.5, -0.5, 1.5, -2.5, 2.4999998, -below], np.float32)
    assert list(peers.std_round(v)) == [0, 1, -1, 2, -3, 2, 0]


def test_one_intellect1_worker_gets_each_chunks_codebook_values_back():
    """sigma from the 2-norm over n - 1, bins 6 sigma / 256 wide about 128 (halves away from
    zero), each bin's value the mean of what fell in it; one worker's ring is its 2 chunks, each
    its owner's total quantized once."""
    x = pseudo(1, (3000,))[0]
    want = np.concatenate([int8_round_trip(x[:1500]), int8_round_trip(x[1500:])])
    assert peers.intellect1_int8_allreduce([x]).tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [2, 4])
def test_intellect1_rounds_each_hop_and_keeps_every_worker_alike(n):
    xs = pseudo(n)
    got = peers.intellect1_int8_allreduce(xs)
    mean = np.mean(xs, axis=0)
    error = np.linalg.norm(got - mean) / np.linalg.norm(mean)
    assert 1e-4 < error < 0.05 and got.shape == mean.shape and got.dtype == np.float32


def test_one_torchft_worker_gets_each_row_at_its_own_scale_twice():
    x = pseudo(1)[0]
    scale = np.float32(448) / np.abs(x).max(axis=1, keepdims=True)
    once = (x * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale
    again = np.float32(448) / np.abs(once).max(axis=1, keepdims=True)
    want = (once * again).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / again
    assert peers.torchft_fp8_allreduce([x]).tobytes() == want.tobytes()


def test_torchft_scales_every_element_of_a_vector_alone_and_refuses_more_dimensions():
    """A 1-D tensor is n rows of one: each element at its own scale, nearly exact."""
    xs = pseudo(4, (1000,))
    assert (np.abs(peers.torchft_fp8_allreduce(xs) - np.mean(xs, axis=0)) <= 1e-6 * np.abs(xs).max()).all()
    with pytest.raises(ValueError, match="1-D and 2-D"):
        peers.torchft_fp8_allreduce(pseudo(2, (4, 4, 4)))


def test_fp4_average_rounds_each_worker_at_its_own_scale():
    from hvd_aps import codec, scaling
    xs = pseudo(3)
    want = np.zeros_like(xs[0])
    for x in xs:
        want = want + codec.quantize(x, "e3m0", shift=scaling.shift_for(float(np.abs(x).max()), 1, "e3m0"))
    assert peers.fp4_average(xs).tobytes() == (want / np.float32(3)).tobytes()
    assert peers.float32_average(xs).tobytes() == ((xs[0] + xs[1] + xs[2]) / np.float32(3)).tobytes()
