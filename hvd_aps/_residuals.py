"""Error feedback's residuals of one compressor, with one owner: per tensor key, side (SEND: what
a rank's codes lost; OWNER: what a shard owner's re-encode lost) and segment start, the committed
ones and those this step writes, and the layout each was committed under (a bucket laid out anew
moves them: hvd_aps.exchange). Transactions as the ExchangeState that holds them: commit() makes
this step's residuals current, rollback() forgets them."""
import numpy as np

from . import _arrays

SEND, OWNER = "send", "owner"  # residual sides: what a rank's codes lost, what a shard owner's re-encode lost


class Residuals:
    """The residual store (see the module docstring); `lock`: its owner's, held for each call."""

    def __init__(self, lock):
        self._lock = lock
        self._kept, self._spare, self._pending = {}, {}, set()
        self._groups, self._written = {}, {}  # residual groups: their flats, by group name (committed_flat())
        self._layouts, self._laid_out = {}, {}

    def committed(self, key: tuple, n: int, xp):
        """The committed residual under `key` (zeros where there is none, or it has another size, as
        after DDP rebuilds its buckets or the world changes: the committed one stays until a step
        commits its successor). Read only."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is None or kept.size != n:
                return xp.zeros(n, xp.float32)
            elif _arrays.array_module(kept) is not xp:  # restored from a checkpoint onto the device
                kept = self._kept[key] = xp.asarray(kept)
            return kept

    def next(self, key: tuple, n: int, xp):
        """Where this step writes the residual under `key`: current once the step commits."""
        with self._lock:
            spare = self._spare.get(key)
            if spare is None or spare.size != n or _arrays.array_module(spare) is not xp:
                spare = self._spare[key] = xp.empty(n, xp.float32)
            self._pending.add(key)
            return spare

    def committed_flat(self, group, keys: tuple, sizes, xp):
        """The committed residuals under `keys` (of `sizes`) end to end in one flat array (read
        only): a bucket's stage reads them in one pass. Where the last step committed this group's
        keys from one flat (next_flat), that flat; else (a checkpoint loaded, residuals moved
        between layouts) one assembled from the keys' residuals, zeros where there are none."""
        with self._lock:
            kept = self._groups.get(group)
            if kept is not None and kept[1] is keys and all(self._kept.get(k) is v for k, v in zip(keys, kept[2])):
                flat = kept[0]
                if _arrays.array_module(flat) is xp:
                    return flat
            flat = xp.zeros(int(sum(sizes)), xp.float32)
            at = 0
            for key, n in zip(keys, sizes):
                part = self._kept.get(key)
                if part is not None and part.size == n:
                    flat[at:at + n] = xp.asarray(part)
                at += n
            return flat

    def next_flat(self, group, keys: tuple, sizes, xp):
        """Where this step writes the residuals under `keys`, end to end in one flat array: each
        key's residual a view of it, current once the step commits."""
        total = int(sum(sizes))
        with self._lock:
            committed, written = self._groups.get(group), self._written.get(group)
            spares = ([written[0]] if written else []) + ([committed[3]] if committed and committed[3] is not None
                                                          else [])
            flat = next((f for f in spares if f.size == total and _arrays.array_module(f) is xp), None)
            if flat is None:
                flat = xp.empty(total, xp.float32)
            views = tuple(flat[a:b] for a, b in zip(_offsets(sizes)[:-1], _offsets(sizes)[1:]))
            for key, view in zip(keys, views):
                self._spare[key] = view
            self._pending.update(keys)
            self._written[group] = (flat, keys, views, committed[0] if committed else None)
            return flat

    # layouts: where each tensor's residuals lie among the ranks -----------------------------------
    def moved(self, keys, side: str, signature: str) -> bool:
        """Whether residuals of these tensors on `side` were committed under another layout than
        `signature` (a bucket DDP rebuilt, a checkpoint resumed on other buckets): they must move
        to the ranks that hold those elements now. The same answer on every rank, as long as every
        rank's state has seen the same steps: all ranks start fresh, or all load their own
        state_dict of the same step (forget_shards() clears the records when the world changes)."""
        with self._lock:
            return any(self._layouts.get((key, side), signature) != signature for key in keys)

    def laid_out(self, keys, side: str, signature: str) -> None:
        """This step's residuals of these tensors on `side` lie as `signature` says (at commit)."""
        with self._lock:
            self._laid_out.update({(key, side): signature for key in keys})

    def held(self, keys, side: str) -> dict:
        """This rank's committed residuals of these tensors on `side`: {(key, side, start): array}."""
        wanted = set(keys)
        with self._lock:
            return {k: r for k, r in self._kept.items() if k[1] == side and k[0] in wanted}

    def moved_in(self, keys, side: str, residuals: dict) -> None:
        """Committed residuals of these tensors on `side` replaced by those that moved here."""
        with self._lock:
            for key in list(self.held(keys, side)):
                del self._kept[key]
            self._kept.update(residuals)

    # transactions -----------------------------------------------------------------------------------
    def commit(self) -> None:
        """This step's residuals become current, with the layouts they were written under."""
        with self._lock:
            for key in self._pending:
                self._kept[key], self._spare[key] = self._spare[key], self._kept.get(key)
                if self._spare[key] is None or self._spare[key].size != self._kept[key].size:
                    del self._spare[key]
            self._layouts.update(self._laid_out)
            for group, (flat, keys, views, before) in self._written.items():
                self._groups[group] = (flat, keys, views, before)  # before: next step's flat to write
            self.rollback()

    def rollback(self) -> None:
        """Forget what this step wrote."""
        with self._lock:
            self._written.clear()
            self._pending.clear()
            self._laid_out.clear()

    def forget_shards(self) -> None:
        """The world changed: shard owners' residuals and every record of where residuals lay go."""
        with self._lock:
            for store in (self._kept, self._spare):
                for key in [k for k in store if k[1] == OWNER]:
                    del store[key]
            self._groups.clear()
            self._layouts.clear()
            self._laid_out.clear()

    # checkpoints --------------------------------------------------------------------------------------
    def state(self) -> tuple:
        """(residuals by checkpoint name, as NumPy copies; layouts by name)."""
        with self._lock:
            residuals = {_name(key): _arrays.to_numpy(r).copy() for key, r in self._kept.items()}
            layouts = {f"{key}|{side}": signature for (key, side), signature in self._layouts.items()}
            return residuals, layouts

    @staticmethod
    def parse(residuals: dict, layouts: dict) -> tuple:
        """A state()'s parts read back (raising on a malformed one): (residuals, layouts) by key."""
        return ({_key(name): np.array(r, np.float32) for name, r in residuals.items()},
                {tuple(name.rsplit("|", 1)): signature for name, signature in layouts.items()})

    def load(self, parsed: tuple) -> None:
        """Replace everything by parse()'s result."""
        with self._lock:
            self._kept, self._layouts = parsed
            self._spare, self._pending, self._groups, self._written, self._laid_out = {}, set(), {}, {}, {}


def _offsets(sizes) -> list:
    out = [0]
    for n in sizes:
        out.append(out[-1] + int(n))
    return out


def _name(key: tuple) -> str:
    """A residual key as a checkpoint name: tensor key, side and segment start."""
    tensor_key, side, start = key
    return f"{tensor_key}|{side}|{start}"


def _key(name: str) -> tuple:
    tensor_key, side, start = name.rsplit("|", 2)
    return tensor_key, side, int(start)
