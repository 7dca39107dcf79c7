"""Buckets the ranks agree on, whatever order their gradients come in.

Horovod negotiates every gradient by name, so a rank whose graph skips a parameter in a step (a
head used on one rank only, a frozen tower, a conditional branch) still meets the others: its
optimizer sends zeros for what its hooks never saw, later than the others send it. A bucket made
of gradients in the order they arrive would then hold other tensors on each rank. So the Horovod
path learns a Layout once, at the end of its first step of several named gradients: every rank
gathers every rank's (key, size) in the order it saw them, and all cut the first rank's order into
buckets alike (where a bucket reaches bucket_bytes, as the order of arrival was cut before, so a
job whose ranks all see one order keeps the same buckets, names and bits). From then on a
gradient goes to its slot by key, and a bucket is exchanged once its last gradient is in.
"""
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from .perf import FLOAT32_BYTES

# keys named in an error message (a model of thousands of tensors would fill a screen)
NAMED = 8


@dataclasses.dataclass(frozen=True)
class Entry:
    """A gradient as a rank saw it: the name Horovod negotiates it by, its label (dtype and
    shape, for messages and stats) and its element count."""
    key: str
    label: str
    size: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Buckets of entries, and every key's slot. `base` numbers the first bucket (after the
    batches of gradients that arrived unnamed in the step that agreed on it), `scope` names the
    buckets apart from other process sets' (name())."""
    buckets: Tuple[Tuple[Entry, ...], ...]
    scope: object = None  # the process set's key (hvd_aps._horovod.set_key; None: the global set)
    base: int = 0
    # key -> (bucket, position in it, position in the layout)
    slots: Dict[str, Tuple[int, int, int]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        where = [(b, i) for b, bucket in enumerate(self.buckets) for i in range(len(bucket))]
        object.__setattr__(self, "slots", {self.buckets[b][i].key: (b, i, k) for k, (b, i) in enumerate(where)})

    @property
    def count(self) -> int:
        return len(self.slots)

    def slot(self, key: str, size: int) -> Optional[Tuple[int, int, int]]:
        """The slot (bucket, index in it, position in the layout) of a gradient of this key and
        size, None where it has none."""
        slot = self.slots.get(key)
        return slot if slot is not None and self.buckets[slot[0]][slot[1]].size == size else None

    def name(self, bucket: int) -> str:
        return name(self.scope, self.base + bucket)


def name(scope, number: int) -> str:
    """A batch's name, equal on the ranks of its process set and apart from every other set's:
    the names of the global set's as they always were."""
    return f"hvd_aps.{number}" if scope is None else f"hvd_aps.set{scope[0]}.{number}"


def cut(entries: Sequence[Entry], bucket_bytes: int, scope=None, base: int = 0) -> Layout:
    """Entries in order, a bucket closed where it reaches bucket_bytes (with the entry that got it
    there)."""
    buckets, open_, nbytes = [], [], 0
    for entry in entries:
        open_.append(entry)
        nbytes += FLOAT32_BYTES * entry.size
        if nbytes >= bucket_bytes:
            buckets.append(tuple(open_))
            open_, nbytes = [], 0
    if open_:
        buckets.append(tuple(open_))
    return Layout(tuple(buckets), scope, base)


def agree(seen: List[Sequence[Entry]], bucket_bytes: int, scope=None, base: int = 0) -> Layout:
    """The Layout every rank makes from every rank's entries (`seen[r]`, rank r's in the order
    it saw them): the first rank's order, cut. Every rank raises the same error where the ranks
    saw other keys or sizes (another model)."""
    first = {e.key: e for e in seen[0]}
    for rank, entries in enumerate(seen[1:], 1):
        mine = {e.key: e for e in entries}
        lacking, extra = sorted(set(first) - set(mine)), sorted(set(mine) - set(first))
        if lacking or extra:
            raise ValueError(f"ranks handed different gradients to the exchange: rank {rank} "
                             + (f"lacks {lacking[:NAMED]}" if lacking else "")
                             + (" and " if lacking and extra else "")
                             + (f"has {extra[:NAMED]} that rank 0 lacks" if extra else "")
                             + " (another model on that rank?)")
        other = next((k for k in first if mine[k].size != first[k].size), None)
        if other is not None:
            raise ValueError(f"ranks handed different gradients to the exchange: {other} ({first[other].label}) has "
                             f"{first[other].size} elements on rank 0 and {mine[other].size} on rank {rank}")
    return cut(seen[0], bucket_bytes, scope, base)
