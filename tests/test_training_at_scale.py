"""examples/training_at_scale.py's core on a tiny configuration: fp32's trajectory is reproducible
bit for bit, a path's trajectory is recorded and scored against fp32's target, and the
error-feedback model (per-worker send residuals and owner residuals kept across steps, written
with hvd_aps's codec functions) gives emulate.codes_allreduce's result bit for bit, step after step."""
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
import training_at_scale as tas  # noqa: E402

TINY = dict(workers=4, steps=5, eval_every=1, global_batch=16)


@pytest.fixture(scope="module")
def digits():
    """The digits CNN task, its loss evaluated on 256 of the training images."""
    torch.set_num_threads(1)
    task, (train_set, (x, y)) = tas._data("digits-cnn")
    return task, (train_set, (x[:256], y[:256]))


def trajectory(digits, path, seed=0, check_steps=0):
    task, data = digits
    return tas.train(task, data, TINY["workers"], seed, path, TINY["steps"], TINY["eval_every"], check_steps,
                     TINY["global_batch"])


def test_fp32_is_reproducible_and_a_path_is_recorded(digits):
    first, params = trajectory(digits, "fp32")
    again, params_again = trajectory(digits, "fp32")
    assert first["curve"] == again["curve"] and len(first["curve"]) == TINY["steps"] + 1
    assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(params, params_again))
    other_seed, _ = trajectory(digits, "fp32", seed=1)
    assert other_seed["curve"][1:] != first["curve"][1:]

    ef, _ = trajectory(digits, "hvd_aps e3m0 + EF", check_steps=3)
    assert ef["real_exchange_steps_checked"] == 3 and ef["real_exchange_bits_equal"] is True
    ring, _ = trajectory(digits, "NCCL ring e4m3")
    records = tas.scored([first, ef, ring])
    for r in records:
        assert r["target"] == dict(map(tuple, first["curve"]))[4]  # fp32's loss at 80 % of 5 steps
        assert np.isfinite(r["final_loss"]) and r["final_vs_fp32"] > 0
    assert records[0]["steps_to_target"] <= 4 and records[0]["final_vs_fp32"] == 1.0
    assert ef["curve"] != first["curve"] and ring["curve"] != first["curve"]
    assert "| hvd_aps e3m0 + EF |" in tas.tables(records)


def test_error_feedback_model_is_the_real_exchange_step_after_step():
    rng = np.random.default_rng(0)
    sizes, n = [5000, 64, 3, 2048, 4097], 4
    model, real = tas.ErrorFeedback("e3m0", n, sizes), tas.RealExchange("e3m0", True, n)
    try:
        for step in range(4):
            x = np.concatenate([rng.normal(0, 10.0 ** rng.integers(-8, 0), (n, s)).astype(np.float32)
                                for s in sizes], axis=1)
            mine = model(x)
            assert mine.tobytes() == real(x, sizes).tobytes(), step
            plain = tas.per_tensor(lambda part: tas.peers.aps_allreduce(part, "e3m0"), x, sizes)
            assert (mine.tobytes() == plain.tobytes()) == (step == 0)  # the residuals act from step 2 on
    finally:
        real.close()
    assert np.any(model.send != 0) and np.any(model.owner != 0)
