"""hvd_aps.fsdp in FSDP2 under real `torchrun` processes (Gloo on loopback), 2 and 3 ranks: the
codes reduce-scatter bit-exact to the NumPy model for every shard, FSDP's own calls included;
training with nested units, resharding on and off, bf16 and fp16 reduce dtypes, error feedback, hybrid."""
import ml_dtypes
import numpy as np
import pytest

import model
from hvd_aps._schedule import max_trial_steps
from horovod_run import load, torchrun
from workers.common import codes_grads, format_mismatch


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"fsdp{request.param}")
    torchrun("fsdp_checks.py", tmp, ranks=request.param, timeout=300)
    return load(tmp, f"fsdp{request.param}", request.param)


def rows_of(rank, world):
    return np.stack([np.concatenate([g.ravel() for g in codes_grads(10 * rank + r)])[:6001] for r in range(world)])


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1fn"])
def test_reduce_scatter_is_bit_exact_to_the_model_for_every_shard(ranks, fmt):
    world = len(ranks)
    want = model.reduce_scatter([rows_of(r, world) for r in range(world)], fmt)
    for r, got in enumerate(ranks):
        assert got[f"direct_{fmt}"].tobytes() == want[r].tobytes(), r


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_reduce_dtype_comes_back_in_its_dtype(ranks, dtype):
    """A reduce_dtype of bfloat16 or float16: codes from the rows' values, each shard's average
    rounded back to the dtype, bit for bit as the model."""
    world = len(ranks)
    want = model.reduce_scatter([model.held_in(rows_of(r, world), dtype) for r in range(world)], "e4m3")
    for r, got in enumerate(ranks):
        assert got[f"direct_{dtype}"].tobytes() == model.held_in(want[r], dtype).tobytes(), r
        assert bool(got[f"direct_{dtype}_dtype_ok"])


def test_non_finite_blocks_reach_their_owner_as_nan(ranks):
    for r, got in enumerate(ranks):
        nan = np.isnan(got["poisoned"])
        assert nan[:model.BLOCK].all() == (r == 0) and not nan[model.BLOCK:].any()
        assert bool(got["avg_refused"])


def test_fsdp_calls_are_bit_exact_to_the_model(ranks):
    """What FSDP itself handed the reduce-scatter (one call per unit: the inner Sequential, then
    the root), through the model, against what each rank got back."""
    world = len(ranks)
    calls = list(ranks[0]["rec_calls"])
    assert calls == ["fsdp.2", "fsdp.root"]
    for k in range(len(calls)):
        inputs = [r[f"rec_{k}_in"].reshape(world, -1) for r in ranks]
        want = model.reduce_scatter(inputs, "e4m3")
        for q, r in enumerate(ranks):
            assert r[f"rec_{k}_out"].tobytes() == want[q].tobytes(), (k, q)


def test_native_reduce_scatter_is_the_float32_average(ranks):
    """policy="auto" with the native path pinned: FSDP's own reduce-scatter, averaged."""
    world = len(ranks)
    rows = np.stack([rows_of(r, world) for r in range(world)]).astype(np.float64)
    for r, got in enumerate(ranks):
        want = rows[:, r].sum(axis=0) / world
        # float32 roundings of a sum in Gloo's order: within a few ulps of the terms' magnitudes
        bound = 4 * np.finfo(np.float32).eps * np.abs(rows[:, r]).sum(axis=0) / world
        assert (np.abs(got["native"] - want) <= bound).all(), r
        if world == 2:  # a sum of two float32 is one rounding, in either order
            exact = (rows[0, r].astype(np.float32) + rows[1, r].astype(np.float32)) / np.float32(2)
            assert got["native"].tobytes() == exact.tobytes()


def test_native_reduce_scatter_in_bfloat16(ranks):
    """fallback="bfloat16": FSDP's own reduce-scatter of the rows cast to bfloat16, averaged in
    float32, counted as 2-byte elements (the worker never imports ml_dtypes: NumPy alone has no
    bfloat16, and the count must not need it)."""
    world = len(ranks)
    rows = np.stack([rows_of(r, world) for r in range(world)])
    for r, got in enumerate(ranks):
        sent = rows[:, r].astype(ml_dtypes.bfloat16).astype(np.float64)
        bound = 4 * float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) * np.abs(sent).sum(axis=0) / world
        assert (np.abs(got["native_bf16"] - sent.sum(axis=0) / world) <= bound).all(), r
        assert str(got["native_bf16_fmt"]) == "bfloat16"
        assert int(got["native_bf16_bytes"]) == (world - 1) * rows.shape[2] * 2


@pytest.mark.parametrize("key", ["plain", "keep_unsharded", "bf16", "fp16", "ef", "hybrid", "auto"])
def test_training_leaves_parameters_identical_on_every_rank(ranks, key):
    for r in ranks:
        assert r[key].tobytes() == ranks[0][key].tobytes() and np.isfinite(r[key]).all()
        assert int(r[f"{key}_units"]) == 2
        # one step of the compressor's state per backward, not per unit
        assert int(r[f"{key}_commits"]) == (max_trial_steps() + 1 if key == "auto" else 4)
    if key == "auto":  # the step trials ran to a decision, the same on every rank
        assert str(ranks[0]["auto_policy"]) in ("codes", "native")
        assert all(str(r["auto_policy"]) == str(ranks[0]["auto_policy"]) for r in ranks)
    if key == "ef":
        assert int(ranks[0]["ef_residuals"]) == 2  # one per FSDP unit, in the state_dict
    assert not np.array_equal(ranks[0][key], ranks[0]["rec"])  # training moved them


def test_settings_that_differ_between_ranks_are_refused_by_apply_on_every_rank(ranks):
    for r in ranks:
        assert str(r["mismatch"]) == format_mismatch(len(ranks))


def test_a_compressor_given_to_a_second_model_is_refused_by_apply_on_every_rank(ranks):
    for r in ranks:
        assert str(r["shared_refused"]).startswith("this APSCompressor already serves a model given to hvd_aps.fsdp")


def test_one_step_per_backward_commits_at_its_end_and_rolls_back_a_failed_one():
    """FSDP reduces module by module inside one backward: the compressor's state commits once,
    when autograd's backward ends; an exchange that raises rolls the step back; an exchange
    outside a backward is a step of its own."""
    import torch
    from hvd_aps.exchanger import Exchanger
    from hvd_aps.fsdp import _BackwardStep
    events = []

    class State:
        def commit(self):
            events.append("commit")

        def rollback(self):
            events.append("rollback")

    steps, x = _BackwardStep(Exchanger(None, State(), None)), torch.ones(3, requires_grad=True)

    def exchanging(fail=False):
        def hook(grad):
            with steps.exchange():
                events.append("exchange")
                if fail:
                    raise RuntimeError("a rank left")
            return grad
        return hook

    def backward(*fails):
        y = x
        for fail in fails:  # the hook nearest the loss runs first
            y = y * 2
            y.register_hook(exchanging(fail))
        y.sum().backward()

    backward(False, False)
    assert events == ["exchange", "exchange", "commit"]
    events.clear()
    with pytest.raises(RuntimeError, match="a rank left"):
        backward(True, False)
    assert events == ["exchange", "exchange", "rollback"]
    events.clear()
    with steps.exchange():
        events.append("exchange")
    assert events == ["exchange", "commit"]
    events.clear()
    backward(False)
    assert events == ["exchange", "commit"]
