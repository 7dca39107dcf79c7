"""Inputs shared by the Horovod worker scripts and the tests that check their outputs."""
import os

import numpy as np

SIZE = 1000


def rank_data(rank, sigma=1e-4, seed=0):
    """Rank-specific gradients: Gaussian(0, sigma), different on every rank."""
    return np.random.default_rng(1000 * seed + rank).normal(0, sigma, SIZE).astype(np.float32)


def poisoned(rank, bad):
    x = rank_data(rank, seed=7)
    if rank == 1:
        x[3] = bad
    return x


def spiked(rank, seed=5):
    """Rank data with one entry 10**4 times the largest on rank 1 only: a 4-bit format flushes
    the rest of the tensor, so hybrid precision must send it wide on every rank."""
    x = rank_data(rank, seed=seed)
    if rank == 1:
        x[3] = 1e4 * np.abs(x).max()
    return x


def keras_data(rank, batch=16):
    rng = np.random.default_rng(50 + rank)
    x = rng.normal(size=(batch, 4)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.25).astype(np.float32)


KERAS_W0 = np.array([[0.1], [0.2], [-0.3], [0.4]], np.float32)
KERAS_LR = 0.1

CODES_SIZES = [(50, 7), (3001,), (16,), (5,), (0,), (1000,)]
DDP_SIZES = [(50, 7), (3001,), (16,), (5,), (1000,)]  # DDP has no empty parameters


# killed_checks.py: its phases in order, the steps of each, the step whose backward a rank dies in
KILLED_PHASES, KILLED_STEPS, KILL_STEP = ("ddp", "fsdp", "hsdp"), 5, 3

# dropin_checks.py's ranks that disagree: APSCompressor(timeout=...) of their run
DISAGREE_TIMEOUT = 1.0

# keras_dropin_checks.py: the layers' widths, which say where each layer's weights lie in a run's flat weights
KERAS_FEATURES, KERAS_HIDDEN = 6, 8  # a trunk Dense(HIDDEN) on FEATURES inputs, then Dense(1) (a head: Dense(1) too)
KERAS_VOCAB, KERAS_WIDTH = 40, 4     # an Embedding table, first in its models' weights


def format_mismatch(world):
    """The settings-differ error every rank raises where rank 0 sends e4m3 and the others e5m2
    (the workers' mismatch): the one field that differs, with each rank's value."""
    others = "rank 1" if world == 2 else f"ranks 1-{world - 1}"
    return (f"APSCompressor settings differ between ranks: fmt: e4m3 on rank 0, e5m2 on {others}. Give every rank "
            "the same APSCompressor arguments")


def codes_grads(rank, sizes=CODES_SIZES):
    """Tensors for the codes path: uneven sizes, a tiny one, an empty one, wide magnitudes."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 1)).astype(np.float32) for s in sizes]


def gather_shard(rank, n):
    """fsdp_gather_checks.py's known shard of rank `rank`: n (up to 8744) values of codes_grads."""
    return np.concatenate([g.ravel() for seed in (10 + rank, 20 + rank) for g in codes_grads(seed)])[:n]


# diloco_checks.py: its settings (DiLoCo's keywords; compression: APSCompressor("e3m0", error_feedback=True)
# where "codes", None for float32), its steps, its model and each rank's batches
DILOCO_SETTINGS = {"float32": dict(compression=None, sync_every=4),
                   "codes": dict(compression="codes", sync_every=4),
                   "streaming": dict(compression="codes", sync_every=4, fragments=2, delay=1, mix=0.5),
                   "int8": dict(compression="int8", sync_every=4)}  # INTELLECT-1's ring: torch.distributed's
DILOCO_STEPS = 16
RING_SIZES = (1, 3, 5, 6, 4099)  # elements of the int8 ring's bits checks: fewer than its chunks, uneven, even


def diloco_settings(backend: str) -> list:
    """The settings a backend runs (INTELLECT-1's ring is torch.distributed's)."""
    return [s for s, o in DILOCO_SETTINGS.items() if backend == "torch" or o["compression"] != "int8"]


def diloco_compressor(kind):
    import hvd_aps
    if kind == "int8":
        from hvd_aps.diloco_peers import Intellect1Int8Ring
        return Intellect1Int8Ring()
    return None if kind is None else hvd_aps.APSCompressor("e3m0", error_feedback=True, seed=9)


def ring_input(size, rank):
    """A pseudo-gradient of `size` elements for the int8 ring's bits checks."""
    return np.random.default_rng(100 * size + rank).standard_normal(size).astype(np.float32)


def diloco_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8))


def diloco_batch(step, rank):
    import torch
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=gen)
    return x, torch.tanh(x[:, :8] * 2) + 0.1 * torch.randn(16, 8, generator=gen)


# model_parallel_checks.py: the pipeline's micro-batches and the width of its layers; the tensor-parallel
# block's input (batch, sequence, width)
MP_MICROBATCHES, MP_WIDTH = 4, 32
TP_SHAPE = (4, 64, 64)


def mp_layers():
    """The pipeline's model: four Linear + Tanh layers, seeded alike everywhere."""
    import torch
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(MP_WIDTH, MP_WIDTH), torch.nn.Tanh()) for _ in range(4)]


def mp_batch():
    import torch
    gen = torch.Generator().manual_seed(3)
    return torch.randn(16, MP_WIDTH, generator=gen), torch.randn(16, MP_WIDTH, generator=gen)


def check_slow_rank_runs(ranks, sleep_s=0.02):
    """slow_rank_checks.py's outputs: every rank holds the same decisions after every step, none
    changes once policy="auto" has decided, the ranks end on the same parameters, and the fast
    rank's step waits for the slow one (sleep_s: its SLEEP_S)."""
    import json
    steps = [list(r["decisions"]) for r in ranks]
    assert steps[0] == steps[1]
    policies = [json.loads(d)["policy"] for d in steps[0]]
    decided = next(i for i, p in enumerate(policies) if p is not None)  # StopIteration: never decided
    assert len(set(steps[0][decided:])) == 1, "a decision changed after policy='auto' decided"
    np.testing.assert_array_equal(ranks[0]["params"], ranks[1]["params"])
    assert np.median(ranks[0]["seconds"]) >= sleep_s


def parameters(net):
    """A torch module's parameters end to end, one NumPy array (FSDP's DTensors gathered whole)."""
    import torch
    return torch.cat([getattr(p, "full_tensor", p.detach)().detach().ravel() for p in net.parameters()]).numpy()


def leave_torchrun():
    """End a torchrun worker once it has saved its results: a barrier (every rank has saved),
    then exit without tearing Gloo down. Torch's Gloo can abort a process in interpreter teardown
    ("terminate called without an active exception": a worker thread dropping a tensor whose
    deleter needs the GIL during finalisation, pytorch/pytorch#179291), and a worker aborting after
    its results are written would fail a test about those results."""
    import torch.distributed as dist
    dist.barrier()
    os._exit(0)



RESUME_MODES = ("straight", "second")  # the resume checks' two launches
# the resume checks' settings: APSCompressor("e3m0", **options) of each (tests/replay.py replays them)
RESUME_DDP = {"feedback": dict(error_feedback=True), "stochastic": dict(rounding="stochastic", seed=11),
              "feedback_one_bucket": dict(error_feedback=True),
              "fsdp": dict(error_feedback=True, rounding="stochastic", seed=3),
              "fsdp_params": dict(error_feedback=True, rounding="stochastic", seed=3)}
RESUME_PARAMS = {"fsdp_params": "e4m3"}  # the settings whose parameters FSDP2 gathers as codes
RESUME_HOROVOD = {"feedback": dict(error_feedback=True), "stochastic": dict(rounding="stochastic", seed=11),
                  "codes_optimizer": dict(error_feedback=True, rounding="stochastic", seed=5),
                  # stochastic again, on another schedule: the bits must not move
                  "stochastic_rescheduled": dict(rounding="stochastic", seed=11, chunk_bytes=1 << 16)}
RESUME_ENGINES = {"stochastic_rescheduled": "numpy"}  # HVD_APS_ENGINE of a setting (default: auto)
RESUME_TF = {"feedback": dict(error_feedback=True, min_elements=0),
             "stochastic": dict(rounding="stochastic", seed=11, min_elements=0)}


def straight_or_resumed(build, settings, prefix, outdir, mode, rank, steps=8, width=256, unloaded=(), more=None):
    """The resume checks' two runs (tests/test_resume.py): `straight` trains every step and, at
    half of them, saves a checkpoint (model, optimizer, compressor) per rank; `second`, a fresh
    process, loads it and trains the rest. build(setting) -> (net, the module to call, optimizer,
    compressor, what closes it). Saves every setting's final parameters to
    OUTDIR/<prefix><mode>_rank<r>.npz; for the settings in `unloaded`, `second` also resumes
    without the compressor's state (the negative control: <setting>_unloaded). more(): further
    arrays the straight run saves beside them."""
    import torch

    def train(setting, span, checkpoint=None, compressor_state=True, save=None):
        net, call, opt, compressor, close = build(setting)
        if checkpoint is not None:
            saved = torch.load(checkpoint, weights_only=False)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            if compressor_state:
                compressor.load_state_dict(saved["compressor"])
        for step in span:
            if step == steps // 2 and save is not None:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                            "compressor": compressor.state_dict()}, save)
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(call(x), y).backward()
            opt.step()
        close()
        return net, opt, compressor

    out = {}
    for setting in settings:
        path = f"{outdir}/{prefix}{setting}_rank{rank}.pt"
        if mode == "straight":
            net, _, _ = train(setting, range(steps), save=path)
        else:
            net, _, _ = train(setting, range(steps // 2, steps), checkpoint=path)
            if setting in unloaded:
                out[f"{setting}_unloaded"] = parameters(train(setting, range(steps // 2, steps), path, False)[0])
        out[setting] = parameters(net)
    if mode == "straight" and more is not None:
        out.update(more())
    np.savez(f"{outdir}/{prefix}{mode}_rank{rank}.npz", **out)
