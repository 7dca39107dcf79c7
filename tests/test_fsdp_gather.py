"""hvd_aps.fsdp's codes all-gather of FSDP2's parameters under real `torchrun` processes (Gloo on
loopback), 2 and 4 ranks (HSDP's 2 x 2 mesh): every rank's shard through the NumPy model of
per-block codes, bit for bit, in the dtype FSDP computes in; the sharded master never rounded;
the gathered copy made anew from the master after every step; resharding on and off, prefetching,
codes in both collectives, bf16 parameters."""
import numpy as np
import pytest

import model
from horovod_run import load, torchrun
from workers.common import gather_shard

SHAPES = [(96, 32), (96,), (96, 96), (96,), (8, 96), (8,)]  # the worker's three Linear layers
UNITS = [(0, 2), (2, 4), (4, 6)]  # each layer's parameters: an FSDP unit
SETTINGS = {"e4m3": "e4m3", "e4m3_keep": "e4m3", "e5m2_grads": "e5m2", "bf16": "e4m3", "hsdp": "e4m3"}
STEPS, LR = 3, 0.05


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"gather{request.param}")
    torchrun("fsdp_gather_checks.py", tmp, ranks=request.param, timeout=300)
    return load(tmp, f"gather{request.param}", request.param)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1fn"])
@pytest.mark.parametrize("n", [6001, 700])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_ranks_shard_arrives_as_the_model_of_its_own_blocks(ranks, fmt, n, dtype):
    """Each rank's shard, as FSDP hands it over (in the output's dtype), each block of 2048 at the
    exponent its own max gives, decoded into the output on every rank alike."""
    world = len(ranks)
    held = (lambda x: x) if dtype == "float32" else (lambda x: model.held_in(x, dtype))
    want = np.concatenate([held(model.reencoded(held(gather_shard(r, n)), fmt)) for r in range(world)])
    key = f"direct_{fmt}_{n}_{dtype}"
    for r, got in enumerate(ranks):
        assert got[key].tobytes() == want.tobytes(), r
        assert int(got[f"{key}_bytes"]) == (world - 1) * message_bytes(n, fmt), r


def message_bytes(n, fmt):
    """One rank's message: its packed codes (to a multiple of 4 bytes), then 2 bytes a block."""
    codes = -(-n * (1 + int(fmt[1]) + int(fmt[3])) // 8)
    return -(-codes // 4) * 4 + 2 * -(-n // model.BLOCK)


def test_a_block_of_no_elements_is_refused(ranks):
    assert "block must be an int in 1..4096" in str(ranks[0]["block_refused"])


def test_raw_bytes_and_another_groups_gather_go_as_fsdp_sends_them(ranks):
    """A module of mixed dtypes (FSDP gathers uint8 bytes) and a gather over a smaller group than
    the shard group's (an integer reshard_after_forward's): exact, no codes."""
    world = len(ranks)
    raw = np.concatenate([np.arange(700, dtype=np.uint8) + r for r in range(world)])
    for r, got in enumerate(ranks):
        assert got["fallback_raw"].tobytes() == raw.tobytes()
        assert got["fallback_exact"].tobytes() == gather_shard(r, 700).astype(np.float32).tobytes()


def test_apply_refuses_what_it_cannot_do_before_setting_anything():
    import torch
    import hvd_aps.fsdp
    with pytest.raises(ValueError, match="needs a compressor .*, params .* or both"):
        hvd_aps.fsdp.apply(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="replicate_group sends the gradients across hosts as codes"):
        hvd_aps.fsdp.apply(torch.nn.Linear(2, 2), None, replicate_group=object(), params="e4m3")
    with pytest.raises(ValueError, match="no FSDPModule in this model"):
        hvd_aps.fsdp.apply(torch.nn.Linear(2, 2), None, params="e4m3")


def copy_of(masters, world, fmt, dtype):
    """The unsharded parameters a gather of the ranks' masters gives: per unit, each rank's shards
    end to end (its dim-0 chunk of each parameter), in `dtype`, through the model."""
    held = (lambda x: x) if dtype == "float32" else (lambda x: model.held_in(x, dtype))
    sizes = [int(np.prod(s)) // world for s in SHAPES]
    cuts = np.cumsum([0] + sizes)
    full = []
    for a, b in UNITS:
        decoded = [held(model.reencoded(held(masters[r][cuts[a]:cuts[b]]), fmt)) for r in range(world)]
        for k in range(a, b):
            lo, hi = cuts[k] - cuts[a], cuts[k + 1] - cuts[a]
            full.append(np.concatenate([d[lo:hi] for d in decoded]))
    return np.concatenate(full)


def trained(ranks):
    """The training settings the worker ran on this many ranks (HSDP on 4)."""
    return [key for key in SETTINGS if f"{key}_losses" in ranks[0]]


def test_the_copy_is_gathered_anew_from_the_master_after_every_step(ranks):
    """After every optimizer step, what FSDP computes with is the model's codes of the stepped
    master shards (not the copy of a step before), the same on every rank."""
    for key in trained(ranks):
        copied_from_the_masters(ranks, key)


def copied_from_the_masters(ranks, key):
    shard_world = 2 if key == "hsdp" else len(ranks)
    dtype = "bfloat16" if key == "bf16" else "float32"
    for step in range(STEPS):
        for group in range(len(ranks) // shard_world):
            masters = [ranks[group * shard_world + r][f"{key}_{step}_master"] for r in range(shard_world)]
            want = copy_of(masters, shard_world, SETTINGS[key], dtype)
            for r in ranks:
                assert r[f"{key}_{step}_copy"].tobytes() == want.tobytes(), (key, step)


def test_the_master_shard_is_never_rounded(ranks):
    """The sharded parameters are untouched by a forward and backward, and each step moves them by
    exactly what SGD makes of the applied gradients: never onto the format's grid."""
    for key in trained(ranks):
        never_rounded(ranks, key)


def never_rounded(ranks, key):
    for r in ranks:
        for step in range(1, STEPS):
            assert bool(r[f"{key}_{step}_untouched"]), (key, step)
            before, grads = r[f"{key}_{step - 1}_master"], r[f"{key}_{step}_grads"]
            stepped = before.astype(np.float64) - LR * grads.astype(np.float64)
            roundings = np.spacing(np.abs(before)) + np.spacing(np.abs(np.float32(LR) * grads))  # float32's
            assert (np.abs(r[f"{key}_{step}_master"] - stepped) <= roundings).all(), (key, step)
        master = r[f"{key}_{STEPS - 1}_master"]
        assert (model.reencoded(master, SETTINGS[key]) != master).mean() > 0.9


def test_codes_train_as_float32_does_and_every_rank_ends_alike(ranks):
    """Three steps: every setting's loss within 3 % of float32's gather (the first step's the same
    model on the codes' copy), the parameters identical across ranks."""
    for r in ranks:
        fp32 = r["fp32_losses"]
        for key in trained(ranks):
            assert np.allclose(r[f"{key}_losses"], fp32, rtol=0.03), key
            assert int(r[f"{key}_units"]) == 4
            assert r[f"{key}_{STEPS - 1}_copy"].tobytes() == ranks[0][f"{key}_{STEPS - 1}_copy"].tobytes()
    sent = [int(ranks[0][f"{key}_bytes"]) for key in ("e4m3", "bf16", "e4m3_keep")]
    assert sent[0] == sent[1] > sent[2] > 0  # codes whatever FSDP computes in; no backward gathers unresharded
