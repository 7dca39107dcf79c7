"""The one step protocol (hvd_aps.exchanger) and the adapters' declared contract."""
import concurrent.futures
import inspect
import pathlib
import sys
import threading
import time

import numpy as np
import pytest

import hvd_aps
from hvd_aps import _tokens, exchange
from hvd_aps._stages import Bucket
from hvd_aps.calibration import Mirror
from support import WAIT_S


class _Events:
    """An exchange state that records what the step did to it."""

    def __init__(self):
        self.events = []

    def commit(self):
        self.events.append("commit")

    def rollback(self):
        self.events.append("rollback")

    def workers(self):
        return _POOL


_POOL = concurrent.futures.ThreadPoolExecutor(4)


def _exchanger():
    return hvd_aps.exchanger.Exchanger(None, _Events(), None)


def test_a_step_commits_once_every_exchange_in_flight_has_ended():
    ex, release = _exchanger(), threading.Event()
    futures = [ex.submit(release.wait, 10) for _ in range(3)]
    ex.end_step()  # handed over while all three still run
    assert ex.state.events == []
    release.set()
    concurrent.futures.wait(futures)
    ex.settle()  # the commit comes with the last future's done callback, after its waiters wake
    assert ex.state.events == ["commit"]
    ex.end_step()  # a step with nothing in flight ends at once
    assert ex.state.events == ["commit", "commit"]


def test_a_step_with_a_failed_exchange_rolls_back_after_the_others_end():
    ex, release = _exchanger(), threading.Event()

    def fail():
        raise RuntimeError("a rank left")

    slow = ex.submit(release.wait, 10)
    failed = ex.submit(fail)
    assert isinstance(failed.exception(10), RuntimeError)
    ex.end_step()
    assert ex.state.events == []  # the slow exchange may still write
    release.set()
    slow.result(10)
    ex.settle()
    assert ex.state.events == ["rollback"]
    ex.submit(lambda: None).result(10)  # the next step starts clean
    ex.end_step()
    ex.settle()
    assert ex.state.events == ["rollback", "commit"]


def test_abort_waits_for_the_exchanges_in_flight_and_rolls_back():
    ex, release, order = _exchanger(), threading.Event(), []

    def slow():
        release.wait(10)
        order.append("exchange ended")

    ex.submit(slow)
    threading.Timer(0.2, release.set).start()
    ex.abort_step()
    order.append("aborted")
    assert order == ["exchange ended", "aborted"] and ex.state.events == ["rollback"]


def test_an_exchange_in_the_callers_thread_that_raises_gives_the_step_up():
    ex = _exchanger()
    with ex.exchange():
        pass
    with pytest.raises(ValueError):
        with ex.exchange():
            raise ValueError("bad bucket")
    assert ex.state.events == ["rollback"]
    ex.end_step()
    assert ex.state.events == ["rollback", "commit"]


def test_the_next_step_waits_for_the_one_ending():
    """An exchange of the next step does not start before the step handed over has committed:
    it must read that step's residuals."""
    ex, release = _exchanger(), threading.Event()
    ex.submit(release.wait, 10)
    ex.end_step()
    started = []
    opener = threading.Thread(target=lambda: (ex.submit(lambda: None).result(10), started.append(
        list(ex.state.events))))
    opener.start()
    opener.join(0.2)
    assert not started  # still waiting
    release.set()
    opener.join(10)
    assert started == [["commit"]]


def test_a_bucket_through_the_exchanger_commits_its_residuals_at_the_steps_end():
    """The real state: error feedback's residual is kept only once the step ends."""
    comp = hvd_aps.APSCompressor("e3m0", error_feedback=True, chunk_bytes=0)
    grads = [np.linspace(-1, 1, 5000, dtype=np.float32)]
    bucket = Bucket.whole("b", ["t"], ["t"], [5000])
    levels = exchange.Levels.flat(Mirror(2))
    before = comp.state_dict()["residuals"]
    comp.exchanger.bucket(levels, bucket, grads[0].copy()).result(10)
    assert comp.state_dict()["residuals"] == before == {}
    comp.exchanger.end_step()
    residuals = comp.state_dict()["residuals"]
    assert residuals and any(np.abs(r).max() > 0 for r in residuals.values())
    assert comp.state_dict()["steps"]["t"] == 1
    comp.close()


def test_a_checkpoint_taken_once_the_step_returned_holds_that_step():
    """The step's commit runs in its last exchange's done callback, after the Future's waiters
    woke: state_dict() right after the framework's step returned waits for it, and holds that
    step's residuals and counts rather than the step before's (as a killed elastic worker's
    survivors once restored a state one step ahead of their checkpoint)."""
    comp = hvd_aps.APSCompressor("e3m0", error_feedback=True, chunk_bytes=0)
    ended = comp.exchanger._ended

    def trailing(error):  # the callback late, as a loaded core makes it
        time.sleep(0.5)
        ended(error)

    comp.exchanger._ended = trailing
    bucket = Bucket.whole("b", ["t"], ["t"], [5000])
    future = comp.exchanger.bucket(exchange.Levels.flat(Mirror(2)), bucket, np.linspace(-1, 1, 5000, dtype=np.float32))
    comp.exchanger.end_step()
    future.result(10)
    saved = comp.state_dict()
    assert saved["steps"].get("t") == 1 and saved["residuals"]
    comp.close()


def _members(protocol) -> dict:
    return {name: member for name, member in vars(protocol).items()
            if not name.startswith("_") and callable(member)}


@pytest.mark.parametrize("framework, protocol", [("torch", _tokens.LayoutAdapter), ("tensorflow", _tokens.Adapter)])
def test_each_adapter_is_the_declared_protocol(framework, protocol):
    """Every function the Horovod path calls is declared on _tokens.Adapter (and, for the
    adapter whose gradients get keys, LayoutAdapter), and each adapter module has it with the
    declared arguments."""
    pytest.importorskip("horovod")
    module = __import__(_tokens.ADAPTERS[framework], fromlist=["threaded"])
    assert isinstance(module, protocol)
    for name, declared in {**_members(_tokens.Adapter), **_members(protocol)}.items():
        expected = list(inspect.signature(declared).parameters)[1:]  # less self
        assert list(inspect.signature(getattr(module, name)).parameters) == expected, name
    assert isinstance(module.threaded, bool)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_exchange_threads_carry_their_names_in_the_os():
    """The exchanger's lanes name themselves in the OS (top -H, perf, /proc show them apart from
    Horovod's and Gloo's threads), and still run the exchanger's own initializer."""
    def os_name():
        return pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    comp = hvd_aps.APSCompressor("e4m3")
    try:
        names = {comp.state.workers().submit(os_name).result(timeout=WAIT_S) for _ in range(8)}
        beside = comp.state.workers().submit(lambda: hvd_aps._host_engine._width()).result(timeout=WAIT_S)
    finally:
        comp.close()
    assert names and all(name.startswith("hvd_aps_lane_") for name in names), names
    assert beside == 1  # codec.beside_compute ran too: its codec calls take one thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and waits in /proc are Linux's")
def test_the_benchmarks_tell_the_threads_apart():
    """examples/benchmark_common.thread_kind: the main thread, the exchanger's lanes by their OS
    name, and a thread no name tells (as Horovod's background loop) by its sleep between cycles."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import benchmark_common
    stop, ids = threading.Event(), []

    def cycling():  # Horovod's background loop: sleeps between cycles
        ids.append(threading.get_native_id())
        while not stop.is_set():
            time.sleep(1e-3)

    comp, loop = hvd_aps.APSCompressor("e4m3"), threading.Thread(target=cycling, name="Thread-horovod-like")
    try:
        lane = comp.state.workers().submit(threading.get_native_id).result(timeout=WAIT_S)
        loop.start()
        for _ in range(50):  # each read looks at every thread's wait once
            benchmark_common.thread_cpu()
            time.sleep(2e-3)
    finally:
        stop.set()
        loop.join(timeout=WAIT_S)
        comp.close()
    kinds = [benchmark_common.thread_kind(t) for t in (threading.get_native_id(), lane, ids[0])]
    assert kinds == ["main", "exchange", "horovod"]
