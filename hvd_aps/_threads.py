"""The package's threads by name in the operating system, as Python 3.14 names its threads itself:
`top -H`, `perf`, `gdb` and /proc/<pid>/task/*/comm then tell the exchange's lanes, the codec's
pool and the DDP hook's lanes from the framework's threads (Horovod's background loop, Gloo's
event loops), which all show the process's own name otherwise (the benchmarks' CPU a step by
kind of thread reads them: examples/benchmark_common.thread_kind).
"""
import concurrent.futures
import ctypes
import ctypes.util
import functools
import sys
import threading
from typing import Callable, Optional

PR_SET_NAME = 15  # prctl(2): name the calling thread
OS_NAME_BYTES = 15  # Linux keeps the first 15 bytes of a thread's name


@functools.lru_cache(maxsize=1)
def _prctl():
    """libc's prctl where the OS names threads with it (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_this_thread() -> None:
    """Give the calling thread its Python name in the OS (its first 15 bytes); a no-op where the
    OS has no such name."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_NAME, ctypes.c_char_p(threading.current_thread().name.encode()[:OS_NAME_BYTES]), 0, 0, 0)


def pool(workers: int, name: str, initializer: Optional[Callable[[], None]] = None
         ) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads are named `name`_0, `name`_1, ... in Python and in the OS, each
    running `initializer` first."""
    def start() -> None:
        name_this_thread()
        if initializer is not None:
            initializer()
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=start)
