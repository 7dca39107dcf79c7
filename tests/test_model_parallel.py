"""hvd_aps.pipelining and hvd_aps.tensor_parallel under real `torchrun` processes (Gloo on loopback,
2 ranks): a pipeline's step (GPipe, 1F1B, interleaved 1F1B) gives the gradients of the same model
with each stage boundary's activation and gradient through the NumPy model of per-block codes,
bit for bit; the codes collectives are the model's sum, reduce-scatter and all-gather bit for bit;
the tensor-parallel styles train as torch's own do, within the format's error, at a quarter of
their bytes."""
import numpy as np
import pytest

import model
from horovod_run import load, torchrun
from workers.common import MP_MICROBATCHES, TP_SHAPE, gather_shard, mp_batch, mp_layers

RANKS = 2
SCHEDULES = {"gpipe": 2, "1f1b": 2, "interleaved": 4}  # the stages each cuts the four layers into


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model_parallel")
    torchrun("model_parallel_checks.py", tmp, ranks=RANKS, timeout=300)
    return load(tmp, "mp", RANKS)


def coded(fmt):
    """A stage boundary as the codes carry it: forward the activation through the model of
    per-block codes in `fmt[0]`, backward its gradient in `fmt[1]`."""
    import torch

    def through(x, f):
        return torch.from_numpy(model.reencoded(x.detach().numpy().ravel().copy(), f).reshape(x.shape))

    class Boundary(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return through(x, fmt[0])

        @staticmethod
        def backward(ctx, grad):
            return through(grad, fmt[1])
    return Boundary.apply


def reference(stages):
    """(each stage's parameter gradients, each micro-batch's loss): the micro-batches in order,
    every boundary coded, the gradients summed and divided by their count (scale_grads)."""
    import torch
    layers, x, y = mp_layers(), *mp_batch()
    per_stage, boundary = len(layers) // stages, coded(("e4m3", "e5m2"))
    losses = []
    for xs, ys in zip(x.chunk(MP_MICROBATCHES), y.chunk(MP_MICROBATCHES)):
        h = xs
        for s in range(stages):
            h = boundary(h) if s else h
            for layer in layers[s * per_stage:(s + 1) * per_stage]:
                h = layer(h)
        loss = torch.nn.functional.mse_loss(h, ys)
        loss.backward()
        losses.append(loss.detach())
    grads = []
    for s in range(stages):
        params = [p for layer in layers[s * per_stage:(s + 1) * per_stage] for p in layer.parameters()]
        grads.append(torch.cat([(p.grad / MP_MICROBATCHES).reshape(-1) for p in params]).numpy())
    return grads, torch.stack(losses).numpy()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_pipeline_step_is_the_model_with_every_boundary_coded(ranks, schedule):
    stages = SCHEDULES[schedule]
    grads, losses = reference(stages)
    for s in range(stages):
        got = ranks[s % RANKS][f"{schedule}_stage{s}_grads"]
        assert got.tobytes() == grads[s].tobytes(), (schedule, s)
    assert ranks[1][f"{schedule}_losses"].tobytes() == losses.tobytes()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stages_send_a_quarter_of_float32s_bytes(ranks, schedule):
    """A micro-batch's 4 x 32 values: 128 code bytes and a block's exponent a message, each way
    but the first stage's backward and the last's forward (which send nothing)."""
    stages = SCHEDULES[schedule]
    for s in range(stages):
        sends = (s < stages - 1) + (s > 0)
        sent = int(ranks[s % RANKS][f"{schedule}_stage{s}_bytes"])
        assert sent == sends * MP_MICROBATCHES * (128 + 2)
        assert sent <= 0.26 * sends * MP_MICROBATCHES * 128 * 4


def test_the_codes_sum_reduce_scatter_and_all_gather_are_the_models(ranks):
    xs = [gather_shard(r, 6000).reshape(4, 1500) for r in range(RANKS)]
    total = model.flat([[x.ravel()] for x in xs], "e4m3", average=False)[0].reshape(4, 1500)
    rows = [np.stack([x[2 * q:2 * q + 2].ravel() for q in range(RANKS)]) for x in xs]
    scattered = model.reduce_scatter(rows, "e4m3")  # averaged: the sum halved, exactly
    gathered = np.concatenate([model.reencoded(x.ravel(), "e4m3").reshape(4, 1500) for x in xs], axis=1)
    for r, got in enumerate(ranks):
        assert got["sum"].tobytes() == total.tobytes(), r
        assert (got["scattered"].ravel() / np.float32(RANKS)).tobytes() == scattered[r].tobytes(), r
        assert got["gathered"].tobytes() == gathered.tobytes(), r


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_codes_styles_give_torchs_outputs_and_gradients_within_the_formats_error(ranks, layout):
    """CodesColwiseParallel then CodesRowwiseParallel against ColwiseParallel then RowwiseParallel:
    outputs, the input's gradient and every parameter's gradient within e4m3's error of torch's own
    (and not equal to them: codes did travel), identical on every rank where replicated."""
    for r in ranks:
        for what in ("out", "input_grad", "grads"):
            codes, exact = r[f"{layout}_codes_{what}"], r[f"{layout}_float32_{what}"]
            error = np.linalg.norm(codes - exact) / np.linalg.norm(exact)
            assert 1e-4 < error < 0.06, (layout, what, error)
    if layout == "tp":
        assert ranks[0]["tp_codes_out"].tobytes() == ranks[1]["tp_codes_out"].tobytes()


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_codes_styles_send_about_a_quarter_of_float32s_bytes(ranks, layout):
    """What torch's styles send in float32, a ring each: plain, the output's allreduce forward
    and the input gradient's backward (2 (N-1)/N of the activation's values each); sequence
    parallel, the input's all-gather and the output's reduce-scatter forward, their twins backward
    ((N-1)/N each of the whole activation). The codes' count takes in their metadata's
    Max-allreduces."""
    elements = int(np.prod(TP_SHAPE))
    float32 = 4 * elements * (2 * 2 * (RANKS - 1) / RANKS if layout == "tp" else 4 * (RANKS - 1) / RANKS)
    for r in ranks:
        assert int(r[f"{layout}_codes_bytes"]) <= 0.26 * float32, (layout, int(r[f"{layout}_codes_bytes"]), float32)


def test_error_feedback_on_activations_is_refused(ranks):
    assert "error feedback has nothing to feed back into" in str(ranks[0]["feedback_refused"])
