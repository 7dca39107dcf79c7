"""DiLoCo's schedule, apart from the torch code that runs it (hvd_aps.diloco) so that the
performance model (hvd_aps.perf_layouts) plans the same schedule users run."""
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each fragment syncs: every `sync_every` inner steps, fragment f at the steps t with
    t = (f + 1) * sync_every / fragments (mod sync_every), applied `delay` steps later."""
    sync_every: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self):
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.sync_every % self.fragments:
            raise ValueError(f"sync_every ({self.sync_every}) must be a multiple of fragments ({self.fragments})")
        if not isinstance(self.delay, int) or isinstance(self.delay, bool) or not (
                0 <= self.delay < self.sync_every // self.fragments):
            raise ValueError(f"delay must be an int in 0..{self.sync_every // self.fragments - 1} (sync_every / "
                             f"fragments: one fragment's exchange at a time), got {self.delay!r}")

    def starting(self, step: int) -> Optional[int]:
        """The fragment whose exchange starts after inner step `step` (1, 2, ...), or None."""
        every = self.sync_every // self.fragments
        return (step // every - 1) % self.fragments if step % every == 0 else None
