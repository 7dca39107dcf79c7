"""One-process emulation of an N-worker low-precision allreduce (CPD's "emulate-node"), for
studying formats, APS and accumulation without a cluster.
"""
import numpy as np

from . import _arrays, _inprocess, codec, exchange
from . import scaling as scaling_math
from ._choice import Choice
from ._stages import Bucket
from .config import Scaling
from .formats import FloatFormat


class Accumulate(Choice):
    """Where an emulated allreduce sums its terms."""
    FP32 = "fp32"      # in float32, in rank order: what hvd_aps's wire paths do
    FORMAT = "format"  # rounded to the format after every addition: the paper's low-precision ring


def _validated(arrays):
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("allreduce needs at least one array")
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"all arrays must have one shape, got {sorted({a.shape for a in arrays})}")
    return [codec._as_float32(a) for a in arrays]


def _summer(accumulate: Accumulate, fmt, kahan):
    """acc, term -> new acc (and compensation) in fp32 or rounded to the format after each add."""
    rnd = (lambda v: v) if accumulate is Accumulate.FP32 else (lambda v: codec.quantize(v, fmt))

    def add(acc, comp, term):
        if not kahan:
            return rnd(acc + term), comp
        y = rnd(term - comp)
        t = rnd(acc + y)
        return t, rnd(rnd(t - acc) - y)

    return add


def allreduce(arrays, fmt, scaling="aps", accumulate="fp32", kahan=False, rounding="nearest", seed=None):
    """The average that N workers (one per array) get from an allreduce carrying `fmt`.

    Each worker rounds its gradient, scaled by the APS shift agreed over all workers
    (scaling="aps"; the x N headroom only with accumulate="format", where the sum could overflow
    the format) or unscaled (scaling="none", the naive cast), onto fmt's grid. The terms are
    summed in rank order in float32 (accumulate="fp32", what hvd_aps's wire paths do) or with a
    rounding to fmt after every addition (accumulate="format", the paper's low-precision ring),
    optionally with Kahan compensation; then unscaled and divided by N. Exact for man_bits <= 10: a float32 sum of two
    such grid values rounds at most once before the format's rounding. A NaN or Inf on any worker
    makes the tensor go unscaled and unrounded, so it stays visible in the result.
    Stochastic rounding draws from (seed, flat index in the stacked workers' arrays).
    """
    fmt = FloatFormat.parse(fmt)
    scaling, accumulate = Scaling.parse(scaling, "scaling"), Accumulate.parse(accumulate, "accumulate")
    stack = np.stack(_validated(arrays))  # (workers, ...): one codec call for all of them
    add = _summer(accumulate, fmt, kahan)
    n = len(stack)
    amax = codec.amax(stack)
    if not np.isfinite(amax):
        return (np.sum(stack, axis=0, dtype=np.float32) / np.float32(n)).astype(np.float32)
    # headroom for the sum where it is accumulated: x N in the format, none needed in float32
    sum_max = fmt.max if accumulate is Accumulate.FORMAT else float(np.finfo(np.float32).max)
    shift = scaling_math.shift_for(amax, n, fmt, sum_max) if scaling is Scaling.APS else 0
    codes = codec.encode(stack, fmt, rounding, seed, shift=shift)
    if accumulate is Accumulate.FP32 and not kahan:
        total = codec.decode_sum(codes, fmt)  # decode and add in rank order, one pass per worker
    else:
        total = comp = np.zeros(stack.shape[1:], np.float32)
        for term in codec.decode(codes, fmt):
            total, comp = add(total, comp, term)
    return (np.ldexp(total, -shift, dtype=np.float32) / np.float32(n)).astype(np.float32)


def codes_allreduce(compressors, grads, name="emulated", ranks_per_host=1, keys=None):
    """The average N workers get from the codes exchange that real ranks run: the one driver
    (hvd_aps.exchange.run, with error feedback, hybrid precision and the run-time schedule as
    configured) on one thread per worker, its collectives meeting in this process
    (hvd_aps._inprocess); ranks_per_host > 1: two levels, float32 inside each host of that many
    workers. compressors: one APSCompressor per worker (each keeps its own residuals and
    schedule); grads[w]: worker w's tensors. keys: the tensors' stable names, which stochastic
    rounding's seeds and the residuals are drawn from (default name[i]; an entry point's own names
    give its bits). Each call is one step. Returns one float32 flat per tensor, worker 0's (every
    worker decodes the same bytes alike), in arrays of its own."""
    world = len(compressors)
    if len(grads) != world:
        raise ValueError(f"{len(grads)} workers' gradients for {world} compressors")
    if ranks_per_host < 1 or world % ranks_per_host:
        raise ValueError(f"ranks_per_host must divide the {world} workers, got {ranks_per_host}")
    levels = (_inprocess.flat_levels(world) if ranks_per_host == 1
              else _inprocess.host_levels(world // ranks_per_host, ranks_per_host))
    flats = [[codec._as_float32(g).ravel() for g in worker] for worker in grads]
    labels = [f"{name}[{i}]" for i in range(len(flats[0]))]
    keys = labels if keys is None else list(keys)
    if len(keys) != len(labels):
        raise ValueError(f"{len(keys)} keys for {len(labels)} tensors")
    bucket = Bucket.whole(name, keys, labels, [f.size for f in flats[0]])
    xp = _arrays.array_module(flats[0][0]) if flats[0] else np  # NumPy, or CuPy for arrays on a GPU
    buckets = [xp.concatenate(worker) if worker else xp.zeros(0, xp.float32) for worker in flats]
    result = xp.empty(sum(bucket.sizes), xp.float32)

    def worker(w):  # one step of worker w's exchanger, as an entry point runs it
        exchanger = compressors[w].exchanger
        exchanger.bucket(levels[w], bucket, buckets[w], threaded=False, out=result if w == 0 else None,
                         average=True)
        exchanger.end_step()

    _inprocess.run_ranks(worker, world)
    return [part.copy() for part in bucket.split(result)]


def codes_reduce_scatter(compressors, inputs, names):
    """One step of the codes reduce-scatter that FSDP2's ranks run (hvd_aps.fsdp: one call per
    module of a backward, the step committed once all are done), on one thread per worker as
    codes_allreduce runs the allreduce. inputs[w][u]: worker w's (N, n_u) float32 rows for module
    u, row r for worker r; names[u]: that module's name (its seeds and residuals are keyed by it).
    Returns results[w][u], worker w's row of module u averaged over the N workers."""
    world = len(compressors)
    if len(inputs) != world or any(len(mine) != len(names) for mine in inputs):
        raise ValueError(f"inputs must hold {len(names)} modules' rows for each of the {world} workers")
    levels = _inprocess.flat_levels(world)

    def worker(w):
        exchanger, coll = compressors[w].exchanger, levels[w].world
        stages = exchanger.scatter_stages(world, w)
        rows = [np.ascontiguousarray(np.asarray(x, np.float32).reshape(world, -1)) for x in inputs[w]]
        outs = [np.empty(x.shape[1], np.float32) for x in rows]
        with exchanger.exchange():
            for name, x, out in zip(names, rows, outs):
                exchanger.state.schedule.unchunked(name)
                exchange.reduce_scatter(stages, name, x, coll, out, world)
        exchanger.end_step()
        return outs

    return _inprocess.run_ranks(worker, world)


def relative_error(result, arrays):
    """||result - exact mean|| / ||exact mean||, the exact mean taken in float64."""
    exact = np.mean(np.asarray(arrays, dtype=np.float64), axis=0)
    return float(np.linalg.norm(result - exact) / np.linalg.norm(exact))


def probe(fmt, ranks=8, size=100_000, sigma=1e-4, seed=0):
    """Rows of (fmt, scaling, accumulate, relative error) for Gaussian(0, sigma) float32 gradients."""
    rng = np.random.default_rng(seed)
    arrays = [rng.normal(0.0, sigma, size).astype(np.float32) for _ in range(ranks)]
    rows = []
    for scaling in Scaling:
        for accumulate in Accumulate:
            result = allreduce(arrays, fmt, scaling=scaling, accumulate=accumulate)
            rows.append((str(FloatFormat.parse(fmt)), str(scaling), str(accumulate), relative_error(result, arrays)))
    return rows
