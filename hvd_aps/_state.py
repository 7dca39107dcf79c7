"""ExchangeState: what a compressor keeps between exchanges, with one owner.

Grouped as torch's PowerSGDState is:
- internal state: error-feedback residuals (hvd_aps._residuals: one per tensor key, side and
  segment, and the layout each was committed under), each tensor's count of finished exchanges
  (stochastic rounding's step), the schedule's timings and decisions (hvd_aps._schedule), buffers;
- the threads exchanges run on (created on first use, stopped by close()).

Steps are transactions. An exchange reads the committed residuals and step counts and writes its
new residuals into spare arrays; commit() (the end of a training step) makes them current and
counts the step, rollback() (a step that raised) forgets them. A failed step therefore leaves the
state as it was, and a step run again after an error gives the bits it would have given.
Stochastic rounding draws from (seed, rank in the codes group: on two levels the host, tensor key,
step, element index), never from call order, so threads cannot change a bit.
"""
import concurrent.futures
import hashlib
import sys
import threading

import numpy as np

from . import _arrays, _threads, codec
from ._residuals import SEND, Residuals
from ._schedule import Schedule

WORKER_THREADS = 2  # one exchange's encoding and decoding overlap another's transfers


class BufferPool:
    """Arrays reused from step to step under stable names: fresh pages of a large allocation cost
    more to fault in than the codec takes to fill them."""

    def __init__(self):
        self._arrays, self._results = {}, {}

    def get(self, name, n: int, dtype, xp):
        buf = self._arrays.get(name)
        if buf is None or buf.size != n or buf.dtype != np.dtype(dtype) or _arrays.array_module(buf) is not xp:
            buf = self._arrays[name] = xp.empty(n, dtype)
        return buf

    def result(self, name, n: int, xp):
        """Last step's result array for `name` where nothing outside holds it any more (the
        gradient it became was dropped), else a new one: results are the largest arrays of the
        exchange, and writing into mapped pages costs a third of faulting in fresh ones."""
        buf = self._results.get(name)
        # references while free: the dict's, `buf`'s and getrefcount's argument
        if buf is None or buf.size != n or _arrays.array_module(buf) is not xp or sys.getrefcount(buf) > 3:
            buf = self._results[name] = xp.empty(n, xp.float32)
        return buf

    def __len__(self) -> int:
        return len(self._arrays) + len(self._results)

    def clear(self) -> None:
        self._arrays.clear()
        self._results.clear()


class ExchangeState:
    """Residuals, step counts, schedule, buffers and threads of one compressor (see the module
    docstring). Picklable: residuals, steps, the seed and the schedule travel; buffers and
    threads are made anew."""

    def __init__(self, seed: int, schedule: Schedule):
        self.seed, self.schedule = int(seed), schedule
        self._lock = threading.RLock()
        self.residuals = Residuals(self._lock)
        self._steps, self._stepped = {}, set()
        self.world = 0          # the ranks of this state's exchanges (0: none yet)
        self.resumed_world = 0  # the ranks of the exchanges a loaded state_dict came from (0: none loaded)
        self.buffers = BufferPool()
        self._workers, self._closed = None, False

    def ran_on(self, world: int) -> None:
        """An exchange over `world` ranks agreed its metadata (which checked resumed_world)."""
        self.world = world

    # steps ----------------------------------------------------------------------------------------
    def step_of(self, tensor_key: str) -> int:
        """How many exchanges of this tensor have committed."""
        with self._lock:
            return self._steps.get(tensor_key, 0)

    def exchanged(self, tensor_keys) -> None:
        """These tensors' exchange of this step is done (counted at commit)."""
        with self._lock:
            self._stepped.update(tensor_keys)

    def commit(self) -> None:
        """The step is over: its residuals become current and its exchanges count."""
        with self._lock:
            self.residuals.commit()
            for tensor_key in self._stepped:
                self._steps[tensor_key] = self._steps.get(tensor_key, 0) + 1
            self._stepped.clear()
            self.schedule.commit()

    def rollback(self) -> None:
        """The step raised: forget what it wrote."""
        with self._lock:
            self.residuals.rollback()
            self._stepped.clear()
            self.schedule.rollback()

    def seed_for(self, rank: int, tensor_key: str, side: str) -> int:
        """Stochastic rounding's seed for one tensor's encode on one side (rank -1 for a shard
        owner's re-encode, whose elements each have one owner whatever the layout), from (seed,
        rank, tensor key, step): the element index is added by the codec's hash."""
        text = f"{self.seed}:{rank}:{tensor_key}:{side}:{self.step_of(tensor_key)}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def values_seed(self, rank: int, label: str) -> int:
        """wire="values": the seed of one tensor's rounding, from its count of exchanges that came
        back (values_done), as seed_for draws from committed steps."""
        return self.seed_for(rank, f"values:{label}", SEND)

    def values_done(self, label: str) -> None:
        """wire="values": this tensor's sum came back (decompress). Its count moves on here, not
        at compress(), so an allreduce that failed in between rounds again with the same seed."""
        key = f"values:{label}"
        with self._lock:
            self._steps[key] = self._steps.get(key, 0) + 1

    def forget_shards(self) -> None:
        """The world changed (elastic reset): shard owners' residuals belong to the old layout,
        and so does every record of where residuals lay (a rank that joins has none, and moving
        residuals is a collective that every rank must agree to run)."""
        with self._lock:
            self.residuals.forget_shards()
            self.world = self.resumed_world = 0
            self.buffers.clear()

    # checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resuming bit for bit needs: residuals (NumPy), where they lay, step counts, seed,
        schedule, and the ranks of the exchanges they came from."""
        with self._lock:
            residuals, layouts = self.residuals.state()
            return {"residuals": residuals, "steps": dict(self._steps), "seed": self.seed,
                    "layouts": layouts, "schedule": self.schedule.state_dict(),
                    "world": self.world or self.resumed_world}

    def load_state_dict(self, state: dict) -> None:
        """Everything read and checked before anything changes: a state that cannot load leaves
        this one as it was."""
        try:
            residuals = Residuals.parse(state["residuals"], state.get("layouts", {}))
            steps = {k: int(v) for k, v in state["steps"].items()}
            world, seed = int(state.get("world", 0)), int(state["seed"])
            schedule = Schedule(self.schedule.candidates, self.schedule.auto, self.schedule.link,
                                self.schedule.natives)
            schedule.load_state_dict(state["schedule"], warn=False)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"not a state_dict this APSCompressor can load ({type(err).__name__}: {err}): pass "
                             "what APSCompressor.state_dict() returned, saved whole") from err
        with self._lock:
            self.residuals.load(residuals)
            self._steps, self._stepped = steps, set()
            self.world, self.resumed_world = 0, world
            self.seed = seed
            self.schedule.load_state_dict(state["schedule"])

    def __getstate__(self) -> dict:
        return {"state": self.state_dict(), "candidates": self.schedule.candidates, "auto": self.schedule.auto,
                "link": self.schedule.link, "natives": [n.value for n in self.schedule.natives],
                "pins": self.schedule.pins}

    def __setstate__(self, saved: dict) -> None:
        schedule = Schedule(saved["candidates"], saved["auto"], saved.get("link"), saved.get("natives", ("float32",)))
        for decisions in saved.get("pins", ()):
            schedule.pin(decisions)
        self.__init__(saved["state"]["seed"], schedule)
        self.load_state_dict(saved["state"])

    # threads --------------------------------------------------------------------------------------
    def workers(self) -> concurrent.futures.Executor:
        """The threads eager exchanges run on (so backward goes on), made on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this compressor was closed: make a new one")
            if self._workers is None:
                self._workers = _threads.pool(WORKER_THREADS, "hvd_aps_lane", codec.beside_compute)
            return self._workers

    def close(self) -> None:
        """Stop the threads (after the exchanges they run) and drop the buffers."""
        with self._lock:
            workers, self._workers, self._closed = self._workers, None, True
        if workers is not None:
            workers.shutdown(wait=True)
        self.buffers.clear()

