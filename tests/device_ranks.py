"""Thread ranks on the counting CuPy stand-in: collectives that move device memory as NCCL does
(nothing they do counts as the package's reads, uploads or allocations), and ranks run on
threads of their own that stop together when one fails."""
import threading
import time

import numpy as np

import counting_cupy as standin
from hvd_aps import _inprocess

RANKS_S = 2 * _inprocess.BARRIER_TIMEOUT_S  # a test's ranks, their barriers bounded


class DeviceCollectives(_inprocess.ThreadCollectives):
    """Thread ranks' collectives on device arrays, their results delivered on the device."""

    def max_allreduce(self, vector, name):
        return self._everyone(name, vector, lambda parts: _like(vector, np.max([_bytes(p) for p in parts], axis=0)))

    def alltoall(self, send, splits, name):
        def mine(parts):
            cuts = [np.concatenate([[0], np.cumsum(_bytes(s))]) for _, s in parts]
            pieces = [_bytes(m)[c[self.rank]:c[self.rank + 1]] for (m, _), c in zip(parts, cuts)]
            return _like(send, np.concatenate(pieces))
        return self._everyone(name, (send, splits), mine)

    def allgather(self, message, name):
        return self._everyone(name, message, lambda parts: _like(message, np.concatenate([_bytes(p) for p in parts])))


def _bytes(a) -> np.ndarray:
    return standin.peek(a)


def _like(given, result: np.ndarray):
    """A collective's result where its input was: on this thread's device, or on the host."""
    return standin.on_device(result) if isinstance(given, standin.ndarray) else result


def run_ranks(rank, world: int, barriers: list) -> None:
    """rank(r) on a thread a rank (named rank-r); a rank that raises breaks the `barriers`, so the
    others stop at once, and its error is raised (not one of the broken barriers it left behind)."""
    errors = []

    def run(r):
        try:
            rank(r)
        except BaseException as error:
            errors.append(error)
            for barrier in barriers:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RANKS_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"{stuck} still running after {RANKS_S} s"
