"""Exchanger: what every entry point hands its exchanges to, and the one step protocol they follow.

An APSCompressor holds one: the configuration, the state (hvd_aps._state), the stats, the threads,
each group's stages, and the *step* in flight, a transaction over the state::

    future = exchanger.submit(fn, *args)     # an exchange on the threads (or a DDP lane's)
    future = exchanger.bucket(levels, ...)   # one bucket through the driver, the same way
    with exchanger.exchange(): ...           # an exchange in the caller's thread
    exchanger.count_native(...); exchanger.pass_through(label, n)   # tensors sent without codes
    exchanger.end_step() / abort_step()      # the step's last exchange handed over / given up

A step opens with its first exchange; end_step() commits once all in flight has ended, or rolls back
where one raised; abort_step() waits for what is in flight and rolls back. Entry points differ only
in when they know the last exchange is handed over (Horovod: at its last decompress()).
"""
import concurrent.futures
import contextlib
import threading
from typing import Callable, Optional

from . import _device, codec, exchange
from ._scatter import ScatterStages
from ._stages import Bucket, CodesStages
from ._state import ExchangeState
from ._stats import StatsRecorder
from .config import APSConfig, Path


class Exchanger:
    """Configuration, state, stats, threads, stages and the step in flight of one compressor
    (see the module docstring)."""

    def __init__(self, config: APSConfig, state: ExchangeState, recorder: StatsRecorder):
        self.config, self.state, self.recorder = config, state, recorder
        self._stages, self._lock = {}, threading.Lock()
        self._step = threading.Condition()
        self._in_flight, self._error, self._ending = 0, None, False

    # stages per group --------------------------------------------------------------------------
    def stages(self, world: int, rank: int, seed_rank: Optional[int] = None) -> CodesStages:
        """The codes exchange's stages for this rank of a codes group of `world` ranks (kept: they
        hold the group's buffers). seed_rank keys stochastic rounding's draws (default `rank`: on
        two levels the host's number, so an element of the host's sum draws alike whichever local
        rank the bucket's layout hands it to; a resumed DDP's first step runs on other buckets
        than the run it resumes had)."""
        key = ("codes", world, rank, rank if seed_rank is None else seed_rank)
        with self._lock:
            if key not in self._stages:
                self._stages[key] = CodesStages(self.config, self.state, self.recorder, *key[1:])
            return self._stages[key]

    def scatter_stages(self, world: int, rank: int) -> ScatterStages:
        """The reduce-scatter's stages for this rank of a group of `world` ranks."""
        key = ("scatter", world, rank)
        with self._lock:
            if key not in self._stages:
                self._stages[key] = ScatterStages(self.config, self.state, self.recorder, world, rank)
            return self._stages[key]

    def forget_stages(self) -> None:
        with self._lock:
            self._stages.clear()

    # the step ------------------------------------------------------------------------------------
    def submit(self, fn: Callable, *args, executor: Optional[concurrent.futures.Executor] = None,
               **kwargs) -> concurrent.futures.Future:
        """Run an exchange of the step on the exchanger's threads (or `executor`) -> its Future."""
        self._opened()
        try:
            future = (executor or self.state.workers()).submit(fn, *args, **kwargs)
        except BaseException as error:
            self._ended(error)
            raise
        future.add_done_callback(lambda done: self._ended(done.exception()))
        return future

    def bucket(self, levels: exchange.Levels, bucket: Bucket, flat, threaded: bool = True,
               place: Optional[_device.Place] = None, **options) -> "concurrent.futures.Future | Done":
        """One bucket (its gradients end to end in `flat`, or a callable that joins them where
        the exchange runs: off the thread that hands the bucket over) through the driver
        (hvd_aps.exchange.run, `options` its keywords) -> a Future of its flat results: on the
        threads where `threaded` (eager torch, so backward goes on), else in the caller's thread
        (TF's ops, which TF itself runs in parallel); on a device at `place` (the stream the
        gradients were made on)."""
        stages = self.stages(levels.cross.world, levels.cross.rank)
        if threaded:
            return self.submit(_run, stages, bucket, flat, levels, _device.branch(place, "exchange"), **options)
        with self.exchange():
            return Done(_run(stages, bucket, flat, levels, place, **options))

    @staticmethod
    def result(future: "concurrent.futures.Future | Done"):
        """An exchange's results, waited for: while the caller waits, the codec takes every core."""
        with codec.awaited():
            return future.result()

    @contextlib.contextmanager
    def exchange(self):
        """An exchange of the step that runs in the caller's thread; if it raises, the step is
        given up at once (abort_step), as a caller that sees the error would."""
        self._opened()
        try:
            yield
        except BaseException as error:
            self._ended(error)
            self.abort_step()
            raise
        self._ended(None)

    def track(self, future) -> None:
        """Count a framework's own asynchronous collective (a torch Future) as in flight."""
        self._opened()
        future.add_done_callback(lambda done: self._ended(_error_of(done)))

    def pass_through(self, label: str, elements: int) -> None:
        """A tensor too small for codes that the framework's own allreduce carried, in the stats."""
        self.recorder.passed_through(label, elements)

    def count_native(self, keys, labelled_sizes, path: Path, world: int,
                     collective: "exchange.Native" = None) -> None:
        """Tensors the framework's own collective carried (policy="auto" chose it) over `world`
        ranks, counted as every native exchange is (hvd_aps.exchange.count_native)."""
        exchange.count_native(self.recorder, self.state, keys, labelled_sizes, path, world,
                              collective or exchange.Native.ALLREDUCE)

    def native_dtype(self) -> Optional[Path]:
        """The schedule's native path for the next exchange (None: codes), read once the step
        before has committed: its commit may change it, and an entry point whose framework goes
        on before its callbacks have run (DDP: a torch Future's waiters wake before its
        callbacks) would read the old path on one rank and the new on another, and their
        collectives would never meet."""
        with self._step:
            self._step.wait_for(lambda: not self._ending)
            return self.state.schedule.native_dtype()

    def end_step(self) -> None:
        """The step's last exchange is handed over: the step commits once every exchange of it
        has ended (at once if none is in flight), or rolls back if one raised."""
        with self._step:
            self._ending = True
            if self._in_flight == 0:
                self._close()

    def settle(self) -> None:
        """Wait until the step handed over (end_step) has committed or rolled back. An exchange's
        waiters wake before its done callbacks run (concurrent.futures and torch Futures alike),
        so the commit, which the last callback makes, can trail the results the framework's step
        returned; what reads or replaces the state (a checkpoint) waits for it here."""
        with self._step:
            self._step.wait_for(lambda: not self._ending)

    def abort_step(self) -> None:
        """Give the step up: wait for its exchanges in flight, then roll it back."""
        with self._step:
            self._step.wait_for(lambda: self._in_flight == 0)
            self._ending, self._error = False, None
            self.state.rollback()

    def _opened(self) -> None:
        with self._step:
            self._step.wait_for(lambda: not self._ending)  # the step before commits first
            self._in_flight += 1

    def _ended(self, error: Optional[BaseException]) -> None:
        with self._step:
            self._in_flight -= 1
            self._error = self._error or error
            if self._ending and self._in_flight == 0:
                self._close()
            self._step.notify_all()

    def _close(self) -> None:
        """End the step (the condition held, nothing in flight)."""
        failed, self._ending, self._error = self._error is not None, False, None
        if failed:
            self.state.rollback()
        else:
            self.state.commit()
        self._step.notify_all()


def _run(stages, bucket: Bucket, flat, levels: exchange.Levels, place, **options):
    """The exchange at `place`, its results complete on the device when returned: their reader
    (decompress, synchronize) reads them on a stream of its own."""
    with _device.entered(place):
        result = exchange.run(stages, bucket, flat() if callable(flat) else flat, levels, **options)
        _device.finished(place)
        return result


class Done:
    """The results of an exchange that ran in the caller's thread, read as a finished Future's.
    Plain Python: TensorFlow's autograph, tracing the caller, converts its result() where it
    warns that it cannot convert concurrent.futures.Future's."""

    def __init__(self, results):
        self._results = results

    def result(self):
        return self._results


def _error_of(done) -> Optional[BaseException]:
    """The error a finished torch Future holds, or None."""
    try:
        done.wait()
    except BaseException as error:
        return error
    return None
