"""Calibration files (`python -m hvd_aps calibrate --out FILE`, `hvd_aps/gpu_projection.json`): their
format, reading and writing, and the link a job predicts from (HVD_APS_LINK). Apart from
hvd_aps.calibration, which times compressors: the compressor reads HVD_APS_LINK through this
module without importing what imports it."""
import contextlib
import dataclasses
import enum
import json
import os
import pathlib
from typing import Optional, Sequence

from . import perf
from .formats import FloatFormat
from .perf import Codec

FORMAT = "calibration/1"


class Kind(str, enum.Enum):
    """Where a calibration file's codec figures come from."""
    MEASURED = "measured"
    PROJECTED = "projected"

# The GPU codec, projected from the kernels' own work counted on the CPU (examples/gpu_projection.py):
# what `plan --device cuda` uses until a device's measurement is given
GPU_PROJECTION = pathlib.Path(__file__).parent / "gpu_projection.json"
LINK_ENV = "HVD_APS_LINK"  # the link the run-time schedule predicts the framework's step over (job_link)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A calibration file's contents for the model: a Codec per format name, the host's copy rate,
    the link measured inside a job and the (hosts, ranks a host) it was measured on (None where the
    file has none), and from the same job each entry point's costs ({perf.EntryPoint: {path name:
    perf.EntryCost}}), the contention of codec and compute and of the framework's allreduce and
    compute (perf.Cluster.contention, wire_contention) and the ranks that shared a machine's
    cores there; whether its codecs were measured or projected, on which
    device, when, and the command that made them; and the repeated timings behind the codecs
    ({format: ((elements, tensors, seconds of each repeat), ...)}) and the link ((elements,
    seconds of each repeat), ...), which hvd_aps.calibration.draws fits again for a range."""
    codecs: dict
    copy: Optional[float] = None
    link: Optional[perf.Link] = None
    link_shape: Optional[tuple] = None
    kind: Kind = Kind.MEASURED
    device: Optional[str] = None
    date: Optional[str] = None
    command: Optional[str] = None
    entry_points: dict = dataclasses.field(default_factory=dict)
    contention: Optional[float] = None
    wire_contention: Optional[float] = None
    sharing: Optional[float] = None
    repeats: dict = dataclasses.field(default_factory=dict)
    link_repeats: tuple = ()

    def entry_cost(self, entry: Optional[perf.EntryPoint], path: str) -> perf.EntryCost:
        """What `path` costs through `entry` in the job measured (nothing where it was not)."""
        return self.entry_points.get(entry, {}).get(path, perf.EntryCost())

    def contentions(self) -> dict:
        """perf.Cluster's contention keywords as measured (its defaults where they were not)."""
        measured = {"contention": self.contention, "wire_contention": self.wire_contention}
        return {key: value for key, value in measured.items() if value is not None}

    def paths(self, entry: perf.EntryPoint, formats: Sequence[str]) -> list:
        """The framework's float32 and 16-bit allreduce, then each format's codes, through `entry`
        with the costs measured there (the codes optimizer's peers: Horovod's own optimizer)."""
        native = entry.native
        return [perf.entry_path(name, bits, entry=native, cost=self.entry_cost(native, name))
                for name, bits in ((perf.FLOAT32_PATH, 32), (perf.HALF_PATH, 16))] + [
            perf.entry_path(perf.codes_path(f), FloatFormat.parse(f).bits, self.codecs[f], entry,
                            self.entry_cost(entry, perf.codes_path(f))) for f in formats]

    def describe(self) -> str:
        """Where its codec figures come from, in a line."""
        if self.kind is Kind.PROJECTED:
            return (f"the codec projected for an {self.device}, not measured ({self.command}, {self.date}); "
                    f"scripts/gpu_check.sh measures it on a device")
        return f"the codec measured on {self.device or 'this machine'}" + (f" on {self.date}" if self.date else "")


def save(calibration: dict, path) -> None:
    """Write a calibration file, keeping the link an earlier `calibrate --links` added to it."""
    links = _read(path).get("links")
    pathlib.Path(path).write_text(json.dumps(calibration | ({"links": links} if links else {}), indent=1) + "\n")


def add_links(path, entry: dict) -> None:
    """Add a measured link (links_entry) to the calibration file at `path`, or start one."""
    data = _read(path) or {"format": FORMAT}
    pathlib.Path(path).write_text(json.dumps(data | {"links": entry}, indent=1) + "\n")


def _read(path) -> dict:
    """A calibration file's contents, {} where there is none yet."""
    path = pathlib.Path(path)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an hvd_aps calibration file ({FORMAT}): run python -m hvd_aps calibrate")
    return data


def links_entry(link: perf.Link, cluster: perf.Cluster, rows: Sequence, costs: Optional[dict] = None) -> dict:
    """A calibration file's "links" entry: the fitted link, the shape it was measured on, the times
    (rows of elements, median seconds and every repeat's seconds: hvd_aps.calibration.time_links),
    and where measured in the same job (hvd_aps.entry_costs.measure) the entry points' costs and
    the steps they were found from, the contentions, and the ranks that shared a machine's cores."""
    entry = {"bandwidth": link.bandwidth, "latency": link.latency, "hosts": cluster.hosts,
             "ranks_per_host": cluster.ranks_per_host,
             "measured": [{"elements": n, "seconds": s, "repeats": list(times)} for n, s, times in rows]}
    if costs:
        entry |= {"entry_points": {e.value: {path: dataclasses.asdict(cost) for path, cost in paths.items()}
                                   for e, paths in costs["entry_points"].items()},
                  "entry_steps": {e.value: paths for e, paths in costs["steps"].items()},
                  "contention": costs["contention"], "wire_contention": costs["wire_contention"],
                  "sharing": cluster.sharing}
    return entry


def job_link() -> Optional[perf.Link]:
    """The link the run-time schedule predicts the framework's step over (hvd_aps._schedule:
    policy="auto" decides from it, policy="codes" warns): HVD_APS_LINK, a rate between hosts
    ("10gbit", at the model's default latency) or a calibration file holding a link measured
    inside a job (`calibrate --links`); None where it is unset."""
    value = os.environ.get(LINK_ENV)
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return perf.Link.parse(value)
    if not pathlib.Path(value).is_file():
        raise ValueError(f"{LINK_ENV} is a link rate (1gbit, 10Gbit/s) or a calibration file with a measured link, "
                         f"got {value!r}")
    link = load(value).link
    if link is None:
        raise ValueError(f"{LINK_ENV}={value} holds no link: add one with `horovodrun (or torchrun) ... -m hvd_aps "
                         f"calibrate --links --out {value}`, or give a rate (10gbit)")
    return link


def load(path) -> Calibration:
    """A calibration file's Codecs, copy rate and measured link."""
    data = _read(path)
    if not data:
        raise ValueError(f"no calibration file {path}: run python -m hvd_aps calibrate --out {path}")
    return parse(data)


def parse(data: dict) -> Calibration:
    """A calibration file's contents (hvd_aps.calibration.calibrate's dict) as a Calibration."""
    links = data.get("links") or {}
    repeats = {fmt: tuple((r["elements"], r["tensors"], tuple(r["repeats"])) for r in rows)
               for fmt, rows in data.get("measured", {}).items() if rows and all("repeats" in r for r in rows)}
    link_repeats = tuple((r["elements"], tuple(r["repeats"])) for r in links.get("measured", ())
                         if "repeats" in r)
    entry_points = {perf.EntryPoint(e): {path: perf.EntryCost(**cost) for path, cost in paths.items()}
                    for e, paths in links.get("entry_points", {}).items()}
    return Calibration({fmt: Codec(**fitted) for fmt, fitted in data.get("codecs", {}).items()}, data.get("copy"),
                       perf.Link(links["bandwidth"], links["latency"]) if links else None,
                       (links["hosts"], links["ranks_per_host"]) if links else None,
                       Kind(data.get("kind", Kind.MEASURED)), data.get("device"), data.get("date"), data.get("command"),
                       entry_points, links.get("contention"), links.get("wire_contention"), links.get("sharing"),
                       repeats, link_repeats if len(link_repeats) == len(links.get("measured", ())) else ())
