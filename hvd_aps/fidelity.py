"""The averaged gradient's relative error each path of `python -m hvd_aps plan` gives, as measured
on real gradients (examples/fidelity_at_scale.py, docs/accuracy.md "At scale, against NCCL's sums")
and kept in hvd_aps/fidelity.json: per path and measured world size, the median over the
measured models and training points. Where a world was not measured, the nearest one (in ratio)
stands for it; paths not measured have none."""
import functools
import json
import math
import pathlib
from typing import Optional

from . import perf

FILE = pathlib.Path(__file__).parent / "fidelity.json"
# what each of plan's paths is in the measurement (its paths' names in examples/fidelity_at_scale.py)
MEASURED_AS = {perf.HALF_PATH: "NCCL ring bf16", perf.codes_path("e4m3"): "hvd_aps e4m3",
               perf.codes_path("e5m2"): "hvd_aps e5m2", perf.codes_path("e3m0"): "hvd_aps e3m0 + EF (1 step)"}


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(FILE.read_text())


def summary(records: list) -> dict:
    """fidelity.json's content from examples/fidelity_at_scale.py's records: {path: {world: the
    median relative error over the records of that path and world}}."""
    errors = {}
    for r in records:
        errors.setdefault(r["path"], {}).setdefault(r["workers"], []).append(r["relative_error"])
    paths = {name: errors[measured] for name, measured in MEASURED_AS.items() if measured in errors}
    return {"measured_as": {name: MEASURED_AS[name] for name in paths},
            "errors": {name: {str(n): _median(v) for n, v in sorted(worlds.items())} for name, worlds in paths.items()}}


def _median(values: list) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def nearest_world(world: int) -> int:
    """The measured world size closest to `world` in ratio."""
    worlds = {int(n) for errors in _table()["errors"].values() for n in errors}
    return min(worlds, key=lambda n: abs(math.log(n / world)))


def error(path: str, world: int) -> Optional[float]:
    """Path `path`'s measured relative error at the measured world nearest `world` (None: not measured)."""
    errors = _table()["errors"].get(path)
    return None if errors is None else errors.get(str(nearest_world(world)))
