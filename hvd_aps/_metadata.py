"""The float64 vector every rank Max-allreduces before an exchange, and the checks on its result.

    [amax..., size..., -size..., error..., timing..., signature, -signature, resumed, -resumed]

amax: each tensor's max |g|; size (and minus it): the Max of x and of -x tells whether every rank
had the same x, so a rank with another model or another order is caught naming the tensor;
error (hybrid precision only): each tensor's sampled narrow-format error, whose Max picks its
format; timing: the last exchange's seconds and candidate, and policy="auto"'s median steps
(hvd_aps._schedule.Schedule.entries; unmeasured: -1); the
signature of the configuration (and minus it), so ranks configured differently fail alike;
resumed (and minus it): the ranks of the exchanges a loaded state_dict came from (0: none
loaded), so a checkpoint resumed on another world size, or on some ranks only, fails on every
rank instead of drifting.
"""
from typing import Optional

import numpy as np

from ._schedule import ENTRIES as TIMING, UNMEASURED

TAIL = 4  # signature, -signature, resumed, -resumed


def vector(config, amaxes, sizes, errors=(), timing=(UNMEASURED,) * TIMING, resumed: int = 0) -> np.ndarray:
    sizes = np.asarray(sizes, np.float64)
    return np.concatenate([np.asarray(amaxes, np.float64), sizes, -sizes, np.asarray(errors, np.float64),
                           np.asarray(timing, np.float64), [config.signature, -config.signature, resumed, -resumed]])


def read(config, agreed, sizes, labels, world: Optional[int] = None) -> tuple:
    """The Max-allreduced vector -> (amaxes, errors, timing), after checking that every rank has
    this configuration and these tensor sizes, and (given the exchange's `world`) resumes from a
    state of that world. errors are zeros without hybrid precision."""
    agreed, count = np.asarray(agreed, np.float64).ravel(), len(sizes)
    hybrid = int(config.hybrid is not None)
    if agreed.size != (3 + hybrid) * count + TIMING + TAIL:
        raise ValueError(f"metadata of {agreed.size} values for {count} tensors: ranks disagree on the bucket")
    _check_resumed(agreed[-2], -agreed[-1], world)
    high, neg_low = agreed[-4], agreed[-3]
    if high != -neg_low:
        raise settings_differ(config, -neg_low, high)
    most, least = agreed[count:2 * count], -agreed[2 * count:3 * count]
    for i in np.flatnonzero(most != least):
        raise ValueError(f"ranks handed different tensors to the exchange: tensor {i} ({labels[i]}) has "
                         f"{sizes[i]} elements here and {least[i]:.0f} to {most[i]:.0f} across ranks "
                         "(another model, or gradients in another order)")
    errors = agreed[3 * count:4 * count] if hybrid else np.zeros(count)
    return agreed[:count], errors, agreed[(3 + hybrid) * count:(3 + hybrid) * count + TIMING]


def settings_differ(config, low: float, high: float) -> ValueError:
    """The error every rank raises where the ranks' compressors are configured differently."""
    return ValueError(f"APSCompressor settings differ between ranks: this rank uses {config!r} (signature "
                      f"{config.signature}), the ranks' signatures range from {low:g} to {high:g}; give every rank "
                      "the same APSCompressor arguments")


def check_same_settings(config, signatures) -> None:
    """At construction (DDP's APSState, FSDP2's apply): every rank's configuration, gathered."""
    if min(signatures) != max(signatures):
        raise settings_differ(config, min(signatures), max(signatures))


def _check_resumed(most: float, least: float, world) -> None:
    """Every rank resumes from a state_dict saved on `world` ranks, or none does."""
    if most != least:
        others = "none" if least == 0 else f"one saved on {least:.0f}"
        raise ValueError(f"ranks resume from different compressor states: some loaded a state_dict saved on "
                         f"{most:.0f} ranks and others {others}: call load_state_dict on every rank, each with its "
                         "own state of the same step, or on none")
    if world is not None and most and most != world:
        raise ValueError(f"this compressor's state_dict was saved by exchanges over {most:.0f} ranks and is resumed "
                         f"over {world}: its residuals and their layout belong to that world. Resume on {most:.0f} "
                         "ranks, or call compressor.on_world_change() after load_state_dict() to drop what belongs "
                         "to the old world (this rank's own residuals and step counts stay)")
