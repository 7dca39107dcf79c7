"""An independent NumPy + ml_dtypes model of the codes exchange's arithmetic, written from its
description (hvd_aps/_stages.py, hvd_aps/_layout.py), for the tests to hold every path against.

Flat, for N ranks: each tensor's APS shift from the max over ranks of its |g| (world N, sums in
float32); each rank's g rounded onto the format at that shift; the N values added in rank order
from +0.0 in float32; every block of BLOCK elements of each tensor's sum re-encoded at the shift
its own max gives (world 1); divided by N for an average. No term depends on chunks or shards.
Two levels: each host's ranks added in local-rank order (from the first, in float32), then the
flat model across the hosts (world H), divided by N.
"""
import ml_dtypes
import numpy as np

from hvd_aps import scaling

BLOCK = 2048
TWINS = {"e4m3": ml_dtypes.float8_e4m3, "e2m1fn": ml_dtypes.float4_e2m1fn, "e5m2": ml_dtypes.float8_e5m2}
F32_MAX = float(np.finfo(np.float32).max)
LOW_PRECISION = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def held_in(x, dtype):
    """float32 x as a model held in `dtype` ("bfloat16", "float16") holds it: nearest-even."""
    return np.asarray(x, np.float32).astype(LOW_PRECISION[dtype]).astype(np.float32)


def near_low_precision_mean(got, terms, dtype):
    """Whether `got`, the average of `terms` (one per rank) taken by a framework's allreduce and
    held in `dtype`, is the float64 average up to a few roundings of the dtype's relative step
    on the terms' magnitudes, and as many of its smallest subnormal (float16's 2**-24)."""
    info, world = ml_dtypes.finfo(LOW_PRECISION[dtype]), len(terms)
    mean = np.sum([t.astype(np.float64) for t in terms], axis=0) / world
    magnitude = np.sum([np.abs(t.astype(np.float64)) for t in terms], axis=0) / world
    bound = 4 * float(info.eps) * magnitude + 4 * float(info.smallest_subnormal)
    return got.shape == mean.shape and bool((np.abs(got - mean) <= bound).all())


def rounded(x, fmt, shift):
    """x on fmt's grid at `shift`, unscaled (ml_dtypes' nearest-even cast)."""
    return np.ldexp(np.ldexp(x, shift).astype(TWINS[fmt]).astype(np.float32), -shift)


def agreed_shift(parts, fmt, world):
    return scaling.shift_for(max(float(np.abs(p).max()) if p.size else 0.0 for p in parts), world, fmt, F32_MAX)


def sum_in_order(terms):
    total = np.zeros_like(terms[0])
    for t in terms:
        total = total + t
    return total


def reencoded(total, fmt, owner=None):
    """Every block of a tensor's sum at its own exponent. owner (error feedback): that tensor's
    owner residual, added first and replaced by what the re-encode lost."""
    out = np.empty_like(total)
    for a in range(0, total.size, BLOCK):
        seg = total[a:a + BLOCK]
        if owner is not None:
            seg = seg + owner[a:a + BLOCK]
        s = scaling.shift_for(float(np.abs(seg).max()), 1, fmt)
        out[a:a + BLOCK] = rounded(seg, fmt, s)
        if owner is not None:
            owner[a:a + BLOCK] = seg - out[a:a + BLOCK]
    return out


def flat(grads, fmt, average=True, owners=None, divisor=None):
    """grads[r][t]: rank r's tensor t (flat float32). Returns the results per tensor. owners
    (error feedback): {t: owner residual}, updated."""
    world = len(grads)
    out = []
    for t in range(len(grads[0])):
        parts = [g[t] for g in grads]
        shift = agreed_shift(parts, fmt, world)
        total = sum_in_order([rounded(p, fmt, shift) for p in parts])
        if owners is not None:
            owners.setdefault(t, np.zeros_like(total))
        result = reencoded(total, fmt, None if owners is None else owners[t])
        out.append(result / np.float32(divisor or world) if average else result)
    return out


def two_levels(grads, fmt, hosts, average=True):
    """grads[r][t] of N = len(hosts) * L ranks, hosts[h] the ranks of host h in local order."""
    sums = []
    for host in hosts:
        per_tensor = []
        for t in range(len(grads[0])):
            total = grads[host[0]][t].copy()
            for r in host[1:]:
                total = total + grads[r][t]
            per_tensor.append(total)
        sums.append(per_tensor)
    return flat(sums, fmt, average, divisor=len(grads))


def with_error_feedback(steps, fmt, average=True):
    """The flat model over several steps (steps[s][r][t]): each rank sends gradient + residual and
    keeps what its codes lost; each tensor's owner does the same for its re-encode."""
    world, count = len(steps[0]), len(steps[0][0])
    residuals = [[np.zeros_like(g) for g in steps[0][0]] for _ in range(world)]
    owners, results = {}, []
    for grads in steps:
        corrected = [[g + r for g, r in zip(gs, rs)] for gs, rs in zip(grads, residuals)]
        results.append(flat(corrected, fmt, average, owners))
        for t in range(count):
            shift = agreed_shift([c[t] for c in corrected], fmt, world)
            for r in range(world):
                residuals[r][t] = corrected[r][t] - rounded(corrected[r][t], fmt, shift)
    return results


def reduce_scatter(inputs, fmt):
    """The codes reduce-scatter: inputs[r] is rank r's (world, n) rows, row q for rank q. Every
    block of BLOCK elements of a row at the shift its max over the ranks gives (world N), the N
    rounded copies added in rank order from +0.0 in float32, divided by N; a block that held
    NaN/Inf on some rank is NaN. Returns each rank's row."""
    world, n = len(inputs), inputs[0].shape[1]
    rows = []
    for q in range(world):
        row = np.full(n, np.nan, np.float32)
        for a in range(0, n, BLOCK):
            parts = [x[q, a:a + BLOCK] for x in inputs]
            if all(np.isfinite(p).all() for p in parts):
                shift = agreed_shift(parts, fmt, world)
                row[a:a + BLOCK] = sum_in_order([rounded(p, fmt, shift) for p in parts]) / np.float32(world)
        rows.append(row)
    return rows


def low_precision_mismatches(ranks, key, grads, want, dtype, shapes):
    """What is wrong with the ranks' low-precision results ranks[r][f"{key}_{i}"] (as float32):
    (r, i) where tensor i is not the model's, want[i] (the codes' model) rounded to the dtype bit
    for bit, or for a tensor not in `want` (too small for codes) not near the float64 average of
    the ranks' grads[q][i]; (r, i, "rank 0") where it is not rank 0's bits; (r, "dtype") where
    rank r's results did not come back in their dtype (f"{key}_dtype_ok")."""
    bad = []
    for r, got in enumerate(ranks):
        for i, shape in enumerate(shapes):
            result = got[f"{key}_{i}"]
            if not (result.tobytes() == held_in(want[i], dtype).reshape(shape).tobytes() if i in want
                    else near_low_precision_mean(result, [g[i] for g in grads], dtype)):
                bad.append((r, i))
            if result.tobytes() != ranks[0][f"{key}_{i}"].tobytes():
                bad.append((r, i, "rank 0"))
        if not bool(got[f"{key}_dtype_ok"]):
            bad.append((r, "dtype"))
    return bad


def stock_reference(arrays, fmt_dtype, fmt, average=True):
    """wire="values" in NumPy: agreed shift (headroom for a float16 sum), ml_dtypes rounding,
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
