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
    file has none); whether its codecs were measured or projected, on which device, when, and the
    command that made them."""
    codecs: dict
    copy: Optional[float] = None
    link: Optional[perf.Link] = None
    link_shape: Optional[tuple] = None
    kind: Kind = Kind.MEASURED
    device: Optional[str] = None
    date: Optional[str] = None
    command: Optional[str] = None

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


def links_entry(link: perf.Link, cluster: perf.Cluster, rows: Sequence) -> dict:
    """A calibration file's "links" entry: the fitted link, the shape it was measured on, the times."""
    return {"bandwidth": link.bandwidth, "latency": link.latency, "hosts": cluster.hosts,
            "ranks_per_host": cluster.ranks_per_host, "measured": [{"elements": n, "seconds": s} for n, s in rows]}


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
    links = data.get("links")
    return Calibration({fmt: Codec(**fitted) for fmt, fitted in data.get("codecs", {}).items()}, data.get("copy"),
                       perf.Link(links["bandwidth"], links["latency"]) if links else None,
                       (links["hosts"], links["ranks_per_host"]) if links else None,
                       Kind(data.get("kind", Kind.MEASURED)), data.get("device"), data.get("date"), data.get("command"))
