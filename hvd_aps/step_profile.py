"""A torch model's training step measured for the performance model (hvd_aps.perf): seconds of
forward, backward and optimizer, and the *timeline* of its backward, when each gradient is ready
(a fraction of the backward), which decides when each exchange can start. A CNN's last layers
hold most of its parameters and are ready early in a backward that spends most of its time in
the first layers; counting readiness in proportion to elements put a ResNet-18's second DDP
bucket (25 MiB) at 58 % of its backward where it is ready at 38 %.

    profile = hvd_aps.step_profile.measure(model, lambda: loss_fn(model(x), y), optimizer)
    hvd_aps.step_profile.save(profile, "step.json")
    # python -m hvd_aps plan --profile step.json --hosts 4 --links 1gbit,10gbit ...

Measured without communication, on one rank: the model's compute as the profile runs it.
"""
import dataclasses
import json
import pathlib
import statistics
import time
from typing import Callable, Optional

from . import perf

FORMAT = "step-profile/1"
REPEATS = 3  # measured steps (after one untimed): the medians are kept


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Seconds of forward, backward and optimizer of one step, and each gradient tensor's
    (elements, fraction of the backward after which it is ready) in the order backward
    produces them (perf.Workload.timeline)."""
    forward: float
    backward: float
    optimizer: float
    timeline: tuple

    @property
    def parameters(self) -> int:
        return sum(n for n, _ in self.timeline)

    def workload(self, **options) -> perf.Workload:
        """The step as the model takes it (`options`: perf.Workload's buckets, shared_processor)."""
        compute = self.forward + self.backward
        return perf.Workload(self.parameters, compute, self.backward / compute if compute else 1.0, self.optimizer,
                             tensors=len(self.timeline), timeline=self.timeline, **options)


def measure(model, loss: Callable[[], object], optimizer=None, repeats: int = REPEATS) -> StepProfile:
    """Time `repeats` steps of `model` (torch.nn.Module): `loss()` runs the forward and returns
    the loss, whose backward is timed with a hook on every parameter (after its gradient is
    accumulated), then `optimizer.step()` if given. Parameters no backward reached are left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    steps = [_one_step(params, loss, optimizer) for _ in range(repeats + 1)][1:]
    reached = [k for k in range(len(params)) if all(k in ready for *_, ready in steps)]
    if not reached:
        raise ValueError("the backward of loss() gave none of the model's parameters a gradient")
    at = {k: min(1.0, statistics.median(ready[k] for *_, ready in steps)) for k in reached}
    order = sorted(reached, key=lambda k: at[k])
    forward, backward, optimizer_step = (statistics.median(s[i] for s in steps) for i in range(3))
    return StepProfile(forward, backward, optimizer_step, tuple((params[k].numel(), at[k]) for k in order))


def _one_step(params: list, loss: Callable[[], object], optimizer) -> tuple:
    """(forward, backward, optimizer seconds, {parameter index: fraction of the backward})."""
    for p in params:
        p.grad = None
    seen = {}

    def ready(k):
        def hook(_):
            seen.setdefault(k, time.perf_counter())
        return hook
    hooks = [p.register_post_accumulate_grad_hook(ready(k)) for k, p in enumerate(params)]
    try:
        start = time.perf_counter()
        value = loss()
        mid = time.perf_counter()
        value.backward()
        end = time.perf_counter()
    finally:
        for h in hooks:
            h.remove()
    if optimizer is not None:
        optimizer.step()
    span = end - mid
    return mid - start, span, time.perf_counter() - end, {k: (t - mid) / span if span else 1.0 for k, t in seen.items()}


def save(profile: StepProfile, path) -> None:
    pathlib.Path(path).write_text(json.dumps(to_json(profile), indent=1) + "\n")


def to_json(profile: StepProfile) -> dict:
    return {"format": FORMAT, **dataclasses.asdict(profile)}


def from_json(data: dict, source: Optional[str] = None) -> StepProfile:
    if data.get("format") != FORMAT:
        raise ValueError(f"{source or 'this'} is not a step profile ({FORMAT}): hvd_aps.step_profile.save writes one")
    return StepProfile(data["forward"], data["backward"], data["optimizer"],
                       tuple((int(n), float(at)) for n, at in data["timeline"]))


def load(path) -> StepProfile:
    return from_json(json.loads(pathlib.Path(path).read_text()), str(path))
