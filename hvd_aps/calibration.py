"""What the performance model (hvd_aps.perf) needs measured on the machine at hand: the codes
exchange's own time per bucket (`python -m hvd_aps calibrate`), written to and read from one
JSON file, so numbers taken on another machine (a GPU's codec) load into the same model.

The exchange is timed on the real driver (hvd_aps.exchange.run, with a compressor configured as
users configure it, stats included), in this one process standing for rank 0 of `world` ranks
that all hold the same gradients: every pass the rank makes (encode, decode-and-sum of the N
copies of its share, re-encode, decode of every share) runs on the real sizes, and nothing waits
for a wire.
"""
import dataclasses
import json
import pathlib
import statistics
import time
from typing import Sequence

import numpy as np

from . import codec, exchange
from ._stages import Bucket
from .compressor import APSCompressor
from .perf import Codec

# (elements, tensors) of the timed buckets: the fit separates a cost per exchange, per tensor
# and per element, so sizes and tensor counts both vary
BUCKETS = ((1 << 14, 1), (1 << 18, 1), (1 << 22, 1), (1 << 14, 16), (1 << 18, 16), (1 << 22, 16))
REPEATS = 5  # timed exchanges per bucket (after one untimed): the median is fitted
FORMAT = "calibration/1"


class Mirror(exchange.Eager):
    """Rank 0 of `world` ranks that hold the same gradients. The metadata and the codes are what
    it would receive from them (they agree on the same shifts and send it the same codes); the
    other owners' re-encoded sums are zeros of their length (decoding costs the same whatever
    the codes), so only rank 0's share of the results is the true average."""

    def __init__(self, world: int):
        self.world, self.rank = world, 0

    def max_allreduce(self, vector, name):
        return vector

    def allreduce(self, values, name):
        return values * self.world

    def alltoall(self, send, splits, name):
        return np.tile(send[:int(splits[0])], self.world)

    def allgather(self, message, name):
        return np.concatenate([message, np.zeros(message.size * (self.world - 1), message.dtype)])


def time_exchange(fmt: str, world: int, elements: int, tensors: int, repeats: int = REPEATS) -> float:
    """Median seconds of one codes exchange of a bucket of `elements` float32 in `tensors` equal
    tensors, as rank 0 of `world` ranks runs it, unchunked."""
    comp = APSCompressor(fmt, chunk_bytes=0)
    stages = comp.stages(world, 0)
    sizes = [elements // tensors] * tensors
    rng = np.random.default_rng(0)
    flats = [rng.standard_normal(n).astype(np.float32) * np.float32(1e-3) for n in sizes]
    outs = [np.empty(n, np.float32) for n in sizes]
    keys = [f"t{i}" for i in range(tensors)]
    bucket = Bucket.whole("calibration", keys, keys, sizes)
    levels = exchange.Levels.flat(Mirror(world))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        exchange.run(stages, bucket, flats, levels, outs=outs, average=True)
        comp.state.commit()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def fit_codec(fmt: str, world: int, buckets: Sequence = BUCKETS, repeats: int = REPEATS) -> tuple:
    """(Codec, [(elements, tensors, seconds)]): least squares of the measured times, relative to
    each (the buckets span three orders of magnitude), on a cost per exchange, per tensor and per
    element (none below zero)."""
    rows = [(n, t, time_exchange(fmt, world, n, t, repeats)) for n, t in buckets]
    seconds = np.array([s for *_, s in rows])
    a = np.array([[1.0, t, n] for n, t, _ in rows]) / seconds[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    fixed, per_tensor, per_element = (max(float(c), 0.0) for c in coef)
    return Codec(fixed, per_element, per_tensor), rows


def calibrate(formats: Sequence[str], world: int, buckets: Sequence = BUCKETS, repeats: int = REPEATS) -> dict:
    """The calibration file's contents for these formats at `world` ranks."""
    codecs, measured = {}, {}
    for fmt in formats:
        fitted, rows = fit_codec(fmt, world, buckets, repeats)
        codecs[fmt] = dataclasses.asdict(fitted)
        measured[fmt] = [{"elements": n, "tensors": t, "seconds": s} for n, t, s in rows]
    return {"format": FORMAT, "engine": codec.engine_name(), "world": world, "codecs": codecs, "measured": measured}


def save(calibration: dict, path) -> None:
    pathlib.Path(path).write_text(json.dumps(calibration, indent=1) + "\n")


def load(path) -> dict:
    """{format name: Codec} from a calibration file."""
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an hvd_aps calibration file ({FORMAT}): run python -m hvd_aps calibrate")
    return {fmt: Codec(**fitted) for fmt, fitted in data["codecs"].items()}
