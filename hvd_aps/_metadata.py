"""The float64 vector every rank Max-allreduces before an exchange, and the checks on its result.

    [amax..., size..., -size..., error..., timing..., signature, -signature]

amax: each tensor's max |g|; size (and minus it): the Max of x and of -x tells whether every rank
had the same x, so a rank with another model or another order is caught naming the tensor;
error (hybrid precision only): each tensor's sampled narrow-format error, whose Max picks its
format; timing: the last exchange's seconds and candidate, and policy="auto"'s median steps
(hvd_aps._schedule.Schedule.entries; unmeasured: -1); the
signature of the configuration (and minus it), so ranks configured differently fail alike.
"""
import numpy as np


from ._schedule import ENTRIES as TIMING, UNMEASURED


def vector(config, amaxes, sizes, errors=(), timing=(UNMEASURED,) * TIMING) -> np.ndarray:
    sizes = np.asarray(sizes, np.float64)
    return np.concatenate([np.asarray(amaxes, np.float64), sizes, -sizes, np.asarray(errors, np.float64),
                           np.asarray(timing, np.float64), [config.signature, -config.signature]])


def read(config, agreed, sizes, labels) -> tuple:
    """The Max-allreduced vector -> (amaxes, errors, timing), after checking that every rank has
    this configuration and these tensor sizes. errors are zeros without hybrid precision."""
    agreed, count = np.asarray(agreed, np.float64).ravel(), len(sizes)
    hybrid = int(config.hybrid is not None)
    if agreed.size != (3 + hybrid) * count + TIMING + 2:
        raise ValueError(f"metadata of {agreed.size} values for {count} tensors: ranks disagree on the bucket")
    high, neg_low = agreed[-2], agreed[-1]
    if high != -neg_low:
        raise ValueError(f"APSCompressor mismatch across ranks: this rank uses {config!r} (signature "
                         f"{config.signature}) but signatures range from {-neg_low:g} to {high:g}")
    most, least = agreed[count:2 * count], -agreed[2 * count:3 * count]
    for i in np.flatnonzero(most != least):
        raise ValueError(f"ranks handed different tensors to the exchange: tensor {i} ({labels[i]}) has "
                         f"{sizes[i]} elements here and {least[i]:.0f} to {most[i]:.0f} across ranks "
                         "(another model, or gradients in another order)")
    errors = agreed[3 * count:4 * count] if hybrid else np.zeros(count)
    return agreed[:count], errors, agreed[(3 + hybrid) * count:(3 + hybrid) * count + TIMING]
