"""The float64 vector every rank Max-allreduces before an exchange, and the checks on its result.

    [amax..., size..., -size..., error..., timing..., signature, -signature, resumed, -resumed]

amax: each tensor's max |g|; size (and minus it): the Max of x and of -x tells whether every rank
had the same x, so a rank with another model or another order is caught naming the tensor;
error (hybrid precision only): each tensor's sampled narrow-format error, whose Max picks its
format; timing: the last exchange's seconds and candidate, and policy="auto"'s median steps (with
codes kept, how far their steps drifted; hvd_aps._schedule.Schedule.entries; unmeasured: -1); the
signature of the configuration (and minus it), so ranks configured differently fail alike (where
they can, after gathering each other's settings to name the fields that differ);
resumed (and minus it): the ranks of the exchanges a loaded state_dict came from (0: none
loaded), so a checkpoint resumed on another world size, or on some ranks only, fails on every
rank instead of drifting.
"""
import json
from typing import Optional, Sequence

import numpy as np

from . import _arrays, _device
from ._schedule import ENTRIES as TIMING, UNMEASURED

TAIL = 4  # signature, -signature, resumed, -resumed
MISSING = "(not set)"  # a field some rank's hvd_aps lacks


def vector(config, amaxes, sizes, errors=(), timing=(UNMEASURED,) * TIMING, resumed: int = 0) -> np.ndarray:
    sizes = np.asarray(sizes, np.float64)
    return np.concatenate([np.asarray(amaxes, np.float64), sizes, -sizes, np.asarray(errors, np.float64),
                           np.asarray(timing, np.float64), [config.signature, -config.signature, resumed, -resumed]])


def with_amaxes(vector: np.ndarray, tensors: np.ndarray, peaks):
    """The vector with peaks[k] as tensor tensors[k]'s amax, where the peaks lie: on a device,
    the vector goes there (one upload) and the maxima never leave it, so the Max-allreduce runs
    on the device and its result is the one read a bucket makes."""
    xp = _arrays.array_module(peaks)
    if xp is np:
        vector[tensors] = peaks
        return vector
    placed = xp.asarray(vector)
    placed[_device.on_device(tensors, peaks)] = peaks
    return placed


def read(config, agreed, sizes, labels, world: Optional[int] = None) -> tuple:
    """The Max-allreduced vector -> (amaxes, errors, timing), after checking that every rank has
    this configuration and these tensor sizes, and (given the exchange's `world`) resumes from a
    state of that world. errors are zeros without hybrid precision."""
    agreed, count = np.asarray(agreed, np.float64).ravel(), len(sizes)
    hybrid = int(config.hybrid is not None)
    if agreed.size != (3 + hybrid) * count + TIMING + TAIL:
        raise ValueError(f"metadata of {agreed.size} values for {count} tensors: ranks disagree on the bucket")
    _check_resumed(agreed[-2], -agreed[-1], world)
    if not same_settings(agreed):
        raise signatures_differ(config, -agreed[-TAIL + 1], agreed[-TAIL])
    most, least = agreed[count:2 * count], -agreed[2 * count:3 * count]
    for i in np.flatnonzero(most != least):
        raise ValueError(f"ranks handed different tensors to the exchange: tensor {i} ({labels[i]}) has "
                         f"{sizes[i]} elements here and {least[i]:.0f} to {most[i]:.0f} across ranks "
                         "(another model, or gradients in another order)")
    errors = agreed[3 * count:4 * count] if hybrid else np.zeros(count)
    return agreed[:count], errors, agreed[(3 + hybrid) * count:(3 + hybrid) * count + TIMING]


def same_settings(agreed) -> bool:
    """Whether every rank's configuration signature was the same, from the Max-allreduced vector
    (every rank holds the same one, so every rank gives the same answer)."""
    agreed = np.asarray(agreed, np.float64).ravel()
    return agreed[-TAIL] == -agreed[-TAIL + 1]


def settings_message(config) -> np.ndarray:
    """This rank's settings as bytes (uint8) to gather where the signatures differ."""
    return np.frombuffer(json.dumps(config.settings()).encode(), np.uint8)


def settings_of(rows) -> list:
    """Every rank's settings from the gathered messages, one row each, zero-padded to one width."""
    return [json.loads(bytes(row).rstrip(b"\0")) for row in rows]


def settings_differ(per_rank: Sequence[dict]) -> ValueError:
    """The error every rank raises where the ranks' compressors are configured differently: each
    field that differs, with every rank's value (the ranks of one value together), so one rank's
    log shows what to align."""
    names = list(dict.fromkeys(name for settings in per_rank for name in settings))
    values = {name: [settings.get(name, MISSING) for settings in per_rank] for name in names}
    differing = [f"{name}: {_by_value(v)}" for name, v in values.items() if len(set(v)) > 1]
    return ValueError(f"APSCompressor settings differ between ranks: {'; '.join(differing)}. Give every rank the "
                      "same APSCompressor arguments")


def _by_value(values: list) -> str:
    """'e4m3 on ranks 0-2, 5, e5m2 on ranks 3-4': every rank's value, the ranks of each as runs."""
    ranks = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on rank{'s' if len(of) > 1 else ''} {_runs(of)}" for value, of in ranks.items())


def _runs(ranks: list) -> str:
    """Ascending ranks as runs: [0, 1, 2, 5] -> '0-2, 5'."""
    runs = []
    for rank in ranks:
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def signatures_differ(config, low: float, high: float) -> ValueError:
    """Where the signatures differ and the ranks cannot gather each other's settings (inside a
    TF graph, whose host stages no collective can run in; wire="values"): this rank's settings
    other than the defaults, to compare with the other ranks' logs."""
    defaults = type(config)(config.fmt).settings()
    own = ", ".join(f"{name}={text}" for name, text in config.settings().items()
                    if name == "fmt" or text != defaults[name])
    return ValueError(f"APSCompressor settings differ between ranks (their signatures range from {low:.0f} to "
                      f"{high:.0f}): this rank's, where not the defaults: {own}. Give every rank the same "
                      "APSCompressor arguments")


def check_same_settings(per_rank: Sequence[dict]) -> None:
    """At construction (DDP's APSState, FSDP2's apply): every rank's settings, gathered."""
    if any(settings != per_rank[0] for settings in per_rank):
        raise settings_differ(per_rank)


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
