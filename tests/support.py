"""Helpers the test files share (no test file imports another): the in-process exchange over
thread ranks against the model, the launches whose outputs several files check, the network
namespaces' probe, TensorBoard's reader."""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

import hvd_aps
import model
from horovod_run import load, torchrun, worker_env
from hvd_aps import exchange
from hvd_aps._inprocess import flat_levels, run_ranks
from hvd_aps._stages import Bucket
from workers.common import CODES_SIZES, DDP_SIZES, codes_grads


def tensorboard_scalars(folder) -> dict:
    """Every scalar in the TensorBoard event files under `folder`, read back with TensorBoard's own
    reader: tag -> [(step, value)] ({} where there are none). torch's SummaryWriter writes scalars,
    tf.summary (TF2) scalar tensors: both are read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = events.Tags()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]}
    scalars.update({tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
                    for tag in tags["tensors"]})
    return scalars


def simulate(grads, compressors, levels=None, average=True, name="bucket", keys=None, commit=True):
    """grads[r][t]: rank r's tensor t. Runs the driver on one thread per rank (flat unless `levels`
    are given), commits the step; returns every rank's results and the bytes each rank sent."""
    world = len(grads)
    levels = levels or flat_levels(world)

    def rank_run(r):
        lv, sizes = levels[r], [g.size for g in grads[r]]
        stages = compressors[r].exchanger.stages(lv.cross.world, lv.cross.rank, r)
        bucket = Bucket.whole(name, keys or [f"{name}[{i}]" for i in range(len(sizes))],
                              [f"{name}[{i}]" for i in range(len(sizes))], sizes)
        out = exchange.run(stages, bucket, np.concatenate(grads[r]), lv, average=average)
        if commit:
            compressors[r].state.commit()
        return [o.copy() for o in bucket.split(out)]

    return run_ranks(rank_run, world), [c.bytes_sent for c in compressors]


def same_format(fmt, world, **options):
    return [hvd_aps.APSCompressor(fmt, **options) for _ in range(world)]


def rank_grads(world, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0)).astype(np.float32) for n in sizes]
            for _ in range(world)]


def launch_ddp_checks(tmp, ranks, script="ddp_checks.py", prefix=None, timeout=240, **env):
    """workers/<script> under torchrun with `ranks` processes: every rank's saved results."""
    torchrun(script, tmp, ranks=ranks, timeout=timeout, env=worker_env(**env))
    return load(tmp, prefix or f"ddp{ranks}", ranks)


def want(order, sizes, fmt="e4m3"):
    """One bucket of tensors `order` (indices into sizes, in the order the exchange sees them)."""
    grads = [[codes_grads(r, sizes)[i].ravel() for i in order] for r in range(4)]
    return dict(zip(order, model.two_levels(grads, fmt, HOSTS)))


def check_levels_ddp(ranks):
    """workers/levels_ddp_checks.py's outputs: the DDP hook on two levels through shared memory,
    bit-exact against the model; HSDP's parameters alike on every rank."""
    expected = want(list(range(len(DDP_SIZES)))[::-1], DDP_SIZES)
    for r in ranks:
        assert bool(r["ddp_two_levels"]) and bool(r["ddp_host_memory"])
        for i in range(len(DDP_SIZES)):
            assert r[f"ddp_{i}"].tobytes() == expected[i].reshape(DDP_SIZES[i]).tobytes(), i
        assert r["hsdp"].tobytes() == ranks[0]["hsdp"].tobytes() and np.isfinite(r["hsdp"]).all()
        assert r["hsdp_torch"].tobytes() == ranks[0]["hsdp_torch"].tobytes()


SCRIPT = Path(__file__).parent.parent / "examples" / "netns_cluster.py"
COMMAND_S = 30  # a short system command (ip, git)
WAIT_S = 60  # the longest a test waits for a thread or a future of its own


def namespaces_work():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    made = subprocess.run(["ip", "netns", "add", f"hvdaps-probe{os.getpid()}"], capture_output=True,
                          timeout=COMMAND_S).returncode == 0
    subprocess.run(["ip", "netns", "del", f"hvdaps-probe{os.getpid()}"], capture_output=True, timeout=COMMAND_S)
    return made


HOSTS = [[0, 1], [2, 3]]


BIG = [i for i, s in enumerate(CODES_SIZES) if np.prod(s) >= 16]


def expected(rank_grads, order, average=True):
    """Every bucket's tensors, in the order the hook saw them, through the model of the exchange."""
    want = {}
    for bucket in order.split(";"):
        idx = [int(i) for i in bucket.split(",")]
        for i, w in zip(idx, model.flat([[g[i].ravel() for i in idx] for g in rank_grads], "e4m3", average)):
            want[i] = w.reshape(DDP_SIZES[i])
    return want


def assert_bit_exact(ranks, key, steps):
    """Every rank's gradients of the `key` run, each step, as the NumPy model gives them."""
    grads = [codes_grads(r, DDP_SIZES) for r in range(len(ranks))]
    for step in range(steps):
        order = ranks[0][f"{key}_{step}_order"].item()
        want = expected(grads, order)
        for r in ranks:
            assert r[f"{key}_{step}_order"].item() == order
            for i in range(len(DDP_SIZES)):
                assert r[f"{key}_{step}_{i}"].tobytes() == want[i].tobytes(), (key, step, i)


def assert_low_precision(ranks, dtype):
    """workers/ddp_checks.py's model held in float16 or bfloat16: every rank's results are the
    model's exchange of the gradients' values, rounded back to the bucket's dtype."""
    grads = [[model.held_in(g, dtype) for g in codes_grads(r, DDP_SIZES)] for r in range(len(ranks))]
    want = expected(grads, ranks[0][f"{dtype}_0_order"].item())
    for r in ranks:
        assert bool(r[f"{dtype}_0_dtype_ok"])
        for i in range(len(DDP_SIZES)):
            assert r[f"{dtype}_0_{i}"].tobytes() == model.held_in(want[i], dtype).tobytes()
