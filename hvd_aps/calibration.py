"""What the performance model (hvd_aps.perf) needs measured on the machine at hand: the codes
exchange's own time per bucket and the host's float32 copy rate (`python -m hvd_aps calibrate`),
and, inside a running job, the link the framework's allreduce gets (`calibrate --links` under
horovodrun or torchrun), written to and read from one JSON file, so numbers taken on another machine (a GPU's
codec, a cluster's links) load into the same model.

The exchange is timed on the real driver (hvd_aps.exchange.run, with a compressor configured as
users configure it, stats included), in this one process standing for rank 0 of `world` ranks
that all hold the same gradients: every pass the rank makes (encode, decode-and-sum of the N
copies of its share, re-encode, decode of every share) runs on the real sizes, and nothing waits
for a wire. On a GPU (`device="cuda"`) the gradients are CuPy arrays, so the CuPy engine's kernels
run, and each exchange is timed to the device's synchronisation.
"""
import concurrent.futures
import contextlib
import dataclasses
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from . import codec, exchange, perf
from ._arrays import array_module
from ._choice import Choice
from ._stages import Bucket
from .calfile import (FORMAT, GPU_PROJECTION, LINK_ENV, Calibration, Kind, add_links, job_link, links_entry, load,
                      parse, save)
from .compressor import APSCompressor
from .perf import Codec

# (elements, tensors) of the timed buckets: the fit separates a cost per exchange, per tensor
# and per element, so sizes and tensor counts both vary
# the calibration files' API (hvd_aps.calfile) is this module's too
__all__ = ["FORMAT", "GPU_PROJECTION", "LINK_ENV", "Calibration", "Kind", "add_links", "job_link", "links_entry",
           "load", "save", "BUCKETS", "DEVICE_BUCKETS", "Device", "DEVICES", "REPEATS", "LINK_ELEMENTS", "Mirror",
           "engine_name", "device_name", "exchange_runner", "time_exchange", "fit_codec", "fit_rows", "time_copy", "fit_link",
           "time_links", "calibrate", "time_exchanges", "DRAWS", "RANGE", "draws", "spread", "parse"]

BUCKETS = ((1 << 14, 1), (1 << 18, 1), (1 << 22, 1), (1 << 14, 16), (1 << 18, 16), (1 << 22, 16), (1 << 18, 256),
           (1 << 22, 256))  # up to the hundreds of tensors a ResNet-50 or a BERT bucket holds
# a GPU's kernels pass 4M elements in tens of microseconds: its fit also takes 256 MiB buckets, as
# a large model's are, so the cost per element is measured where it is not hidden by launches
DEVICE_BUCKETS = BUCKETS + ((1 << 26, 1), (1 << 26, 16))


class Device(Choice):
    """Where the codec is calibrated."""
    CPU = "cpu"    # the host's engine
    CUDA = "cuda"  # CuPy's kernels on the current CUDA device


DEVICES = tuple(d.value for d in Device)
REPEATS = 5  # timed exchanges per bucket (after one untimed): the median is fitted
DRAWS = 200  # calibrations fitted again from resampled repeats: a prediction's range (draws)
RANGE = 90   # percent of those draws' predictions a range holds (the 5th to the 95th percentile)
COPY_ELEMENTS = 1 << 23  # float32 a core copies per timed copy: 32 MiB, past the caches as gradients are
# float32 elements of the framework's allreduces timed for the link fit: latency-bound to bandwidth-bound
LINK_ELEMENTS = (1 << 6, 1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 23)


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
        return array_module(send).tile(send[:int(splits[0])], self.world)

    def allgather(self, message, name):
        xp = array_module(message)
        return xp.concatenate([message, xp.zeros(message.size * (self.world - 1), message.dtype)])


def _device(device: Device) -> tuple:
    """(array module, wait): where the timed gradients live, and what waits for its work to end."""
    if device is Device.CPU:
        return np, lambda: None
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except (ImportError, RuntimeError) as e:  # CuPy's CUDARuntimeError is a RuntimeError
        raise ValueError(f"calibrating on cuda needs CuPy and a CUDA device ({e}): pip install "
                         f"'hvd_aps[cupy]' on a GPU machine, or calibrate on the cpu") from e
    return cupy, cupy.cuda.Device().synchronize


def _parsed(device) -> Device:
    """A device given by name (or a Device) -> a Device; the error names the choices."""
    if device not in DEVICES:
        raise ValueError(f"device is one of {DEVICES}, got {device!r}")
    return Device(device)


def engine_name(device: "Device | str") -> str:
    """The codec's engine on `device`: the CPU's (codec.engine_name()), or "cupy" on a GPU."""
    return codec.engine_name() if _parsed(device) is Device.CPU else "cupy"


def device_name(device: "Device | str") -> str:
    """The processor the codec ran on, for the calibration file: the GPU's name, or "cpu"."""
    device = _parsed(device)
    if device is Device.CPU:
        return Device.CPU.value
    cupy, _ = _device(device)
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


@contextlib.contextmanager
def exchange_runner(fmt: str, world: int, elements: int, tensors: int, device: "Device | str" = Device.CPU):
    """A function that runs one codes exchange of a bucket of `elements` float32 in `tensors`
    equal tensors, as rank 0 of `world` ranks runs it, unchunked, on `device` ("cpu" or
    "cuda"), to its end; its compressor's threads stop on leaving the context."""
    xp, wait = _device(_parsed(device))
    comp = APSCompressor(fmt, chunk_bytes=0)
    stages = comp.exchanger.stages(world, 0)
    sizes = [elements // tensors] * tensors
    rng = np.random.default_rng(0)
    flat = xp.asarray(rng.standard_normal(sum(sizes)).astype(np.float32) * np.float32(1e-3))
    out = xp.empty(flat.size, np.float32)
    keys = [f"t{i}" for i in range(tensors)]
    bucket = Bucket.whole("calibration", keys, keys, sizes)
    levels = exchange.Levels.flat(Mirror(world))

    def run():
        exchange.run(stages, bucket, flat, levels, out=out, average=True)
        comp.state.commit()
        wait()
    with comp:
        yield run


def time_exchanges(fmt: str, world: int, elements: int, tensors: int, repeats: int = REPEATS,
                   device: "Device | str" = Device.CPU) -> list:
    """Seconds of each of `repeats` exchange_runner() exchanges, after one untimed."""
    times = []
    with exchange_runner(fmt, world, elements, tensors, device) as run:
        for _ in range(repeats + 1):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return times[1:]


def time_exchange(fmt: str, world: int, elements: int, tensors: int, repeats: int = REPEATS,
                  device: "Device | str" = Device.CPU) -> float:
    """Median seconds of one exchange_runner() exchange, after one untimed."""
    return statistics.median(time_exchanges(fmt, world, elements, tensors, repeats, device))


def fit_codec(fmt: str, world: int, buckets: Sequence = BUCKETS, repeats: int = REPEATS,
              device: "Device | str" = Device.CPU) -> tuple:
    """(Codec, [(elements, tensors, median seconds, every repeat's seconds)]): least squares of
    the medians, relative to each (the buckets span three orders of magnitude), on a cost per
    exchange, per tensor and per element (none below zero); a Codec of a GPU is a `device` one
    (perf.Codec.busy)."""
    device = _parsed(device)
    timed = [(n, t, time_exchanges(fmt, world, n, t, repeats, device))
             for n, t in tqdm(buckets, desc=f"calibrate {fmt} on {device}", unit="bucket", leave=False)]
    rows = [(n, t, statistics.median(times), times) for n, t, times in timed]
    return fit_rows([row[:3] for row in rows], device=device is not Device.CPU), rows


def fit_rows(rows: Sequence, device: bool) -> Codec:
    """The Codec whose time() best fits (elements, tensors, seconds) rows: least squares relative to
    each time, on a cost per exchange, per tensor and per element (none below zero)."""
    seconds = np.array([s for *_, s in rows])
    a = np.array([[1.0, t, n] for n, t, _ in rows]) / seconds[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    fixed, per_tensor, per_element = (max(float(c), 0.0) for c in coef)
    return Codec(fixed, per_element, per_tensor, device=device)


def time_copy(elements: int = COPY_ELEMENTS, repeats: int = REPEATS) -> float:
    """Seconds per float32 element this host copies through its memory, every core this process
    may use copying at once (as the ranks of a host do; hvd_aps.perf.Cluster.copy): the median of
    `repeats` rounds after one untimed."""
    cores = len(os.sched_getaffinity(0))
    sources = [np.ones(elements, np.float32) for _ in range(cores)]
    targets = [np.empty(elements, np.float32) for _ in range(cores)]
    times = []
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:  # NumPy copies outside the GIL
        for _ in range(repeats + 1):
            started = time.perf_counter()
            list(pool.map(np.copyto, targets, sources))
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) / (cores * elements)


def fit_link(rows: Sequence, cluster: perf.Cluster) -> perf.Link:
    """The Link (bandwidth, latency) with which hvd_aps.perf.allreduce predicts the measured
    (float32 elements, seconds) of the framework's allreduce on `cluster`'s shape: the cost a byte
    from least squares on the times themselves (the large messages, which gradients are, decide
    it), then the latency a message step as the median of what the messages the latency
    dominates leave beyond their bytes (small messages' times are noisy: fitted together, two
    of them off by half moved a 1 Gbit/s link's bandwidth by a third)."""
    # allreduce() over links of one byte a second and no latency counts the bytes through a link;
    # of nothing over links of one second a message step, the message steps
    unit = perf.Cluster(cluster.hosts, perf.Link(1.0, 0.0), cluster.ranks_per_host, perf.Link(1.0, 0.0),
                        tree=cluster.tree)
    steps = perf.allreduce(0, dataclasses.replace(unit, between=perf.Link(1.0, 1.0), inside=perf.Link(1.0, 1.0)))
    seconds = np.array([s for _, s in rows])
    units = np.array([perf.allreduce(n * perf.FLOAT32_BYTES, unit) for n, _ in rows])
    (_, per_byte), *_ = np.linalg.lstsq(np.stack([np.full(len(rows), steps), units], 1), seconds, rcond=None)
    if per_byte <= 0:
        raise ValueError(f"the allreduce's times do not grow with its size ({rows}): time larger messages")
    left = seconds - units * per_byte
    latency_bound = left > units * per_byte  # the latency more than half the time
    latency = float(np.median(left[latency_bound] if latency_bound.any() else left[:1])) / steps
    return perf.Link(1.0 / float(per_byte), max(latency, 0.0))


def time_links(allreduce: Callable[[np.ndarray], object], cluster: perf.Cluster,
               elements: Sequence[int] = LINK_ELEMENTS, repeats: int = REPEATS) -> tuple:
    """(Link, [(elements, median seconds, every repeat's seconds)]): the framework's float32
    `allreduce` (a blocking call every rank makes alike) timed inside the job at each size,
    `repeats` times after one untimed, and the medians fitted as fit_link does. Every rank must
    call it."""
    rows = []
    for n in elements:
        values = np.ones(n, np.float32)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            allreduce(values)
            times.append(time.perf_counter() - started)
        rows.append((n, statistics.median(times[1:]), times[1:]))
    return fit_link([row[:2] for row in rows], cluster), rows


def calibrate(formats: Sequence[str], world: int, buckets: Optional[Sequence] = None, repeats: int = REPEATS,
              device: "Device | str" = Device.CPU) -> dict:
    """The calibration file's contents for these formats at `world` ranks, the codec on `device`
    (its buckets by default BUCKETS, DEVICE_BUCKETS on a GPU); the date says when it was measured."""
    device = _parsed(device)
    buckets = buckets or (BUCKETS if device is Device.CPU else DEVICE_BUCKETS)
    codecs, measured = {}, {}
    for fmt in formats:
        fitted, rows = fit_codec(fmt, world, buckets, repeats, device)
        codecs[fmt] = dataclasses.asdict(fitted)
        measured[fmt] = [{"elements": n, "tensors": t, "seconds": s, "repeats": times} for n, t, s, times in rows]
    return {"format": FORMAT, "engine": engine_name(device),
            "device": device_name(device), "date": time.strftime("%Y-%m-%d"), "world": world,
            "codecs": codecs, "measured": measured, "copy": time_copy(repeats=repeats)}


def draws(calibrated: Calibration, count: int = DRAWS, seed: int = 0) -> list:
    """`count` calibrations fitted again from `calibrated`'s own repeated timings, each bucket's
    (and each link size's) median taken over its repeats drawn again with replacement (a
    bootstrap): how far the fit moves with the noise of the timings behind it, alike on every
    run. [] where the file kept no repeats (older files, projections)."""
    if not calibrated.repeats:
        return []
    rng = np.random.default_rng(seed)

    def median(times):
        return float(np.median(rng.choice(times, len(times))))

    shape = calibrated.link_shape
    unit = perf.Cluster(shape[0], perf.Link(1.0), shape[1]) if shape else None
    out = []
    for _ in range(count):
        codecs = {fmt: fit_rows([(n, t, median(times)) for n, t, times in rows], calibrated.codecs[fmt].device)
                  for fmt, rows in calibrated.repeats.items()}
        link = calibrated.link
        if calibrated.link_repeats and unit is not None:
            link = fit_link([(n, median(times)) for n, times in calibrated.link_repeats], unit)
        out.append(dataclasses.replace(calibrated, codecs={**calibrated.codecs, **codecs}, link=link))
    return out


def spread(values: Sequence[float]) -> tuple:
    """(low, high): the central RANGE percent of the draws' predictions."""
    low, high = np.percentile(np.asarray(values, np.float64), [(100 - RANGE) / 2, (100 + RANGE) / 2])
    return float(low), float(high)
