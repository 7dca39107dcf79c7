"""Float32 between the ranks of one host through shared memory: the inner level of the two-level
exchange on the CPU, in place of collectives over the host's own TCP stack (which copy every byte
through the kernel twice, on the cores backward needs).

Each rank writes what it sends into its own *box*, one per collective name (buckets exchange at
once on the compressor's threads), and publishes it with a counter; every peer copies its part out
and acknowledges; a box is written again only once every peer acknowledged its last message.
Boxes are sparse files under /dev/shm, reserved with posix_fallocate, so a /dev/shm too small for
a bucket (Docker's default is 64 MiB) raises an error that says so instead of a SIGBUS. A box's
file is unlinked once every peer has mapped it, so a job leaves nothing behind however it ends (a
dead process's files are removed by the next job that opens boxes on the host). A rank waiting
for a peer that exited, or `timeout` seconds for one that never comes, raises instead of hanging.
CUDA arrays never come here: they go through `fallback`, the framework's own collectives.
See docs/how-it-works.md ("Two levels").
"""
import mmap
import os
import re
import secrets
import threading
import time
import warnings
from typing import Callable, Optional, Sequence

import numpy as np

from . import _arrays, _host_engine, exchange
from .config import DEFAULT_TIMEOUT

ENV = "HVD_APS_HOST_MEMORY"  # 0: float32 inside a host through the framework's collectives instead
DIRECTORY = "/dev/shm"
PREFIX = "hvd_aps"
CAPACITY = 1 << 36  # virtual bytes of one box's data; sparse: only what is written takes memory
LINE = 64           # bytes: each counter on its own cache line
PAGE = 4096
POLL_FIRST, POLL_MAX = 20e-6, 1e-3  # seconds between looks at a peer's counter, growing
LIVENESS_SECONDS = 1.0              # how often a rank that waits checks that its peers still run
CLOSE_SECONDS = 30.0                # how long close() waits for peers to read this rank's last messages
_FILE = re.compile(rf"^{PREFIX}\.\w+\.h\d+\.(\d+)\.")


def available() -> bool:
    """Shared memory boxes can work here: a /dev/shm and the host engine's atomic counters, and
    HVD_APS_HOST_MEMORY is not 0."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (float32 inside a host through the framework's collectives) or 1 (through "
                         f"shared memory, the default), got {value!r}")
    return value == "1" and _host_engine.available and os.path.isdir(DIRECTORY)


class _Box:
    """One rank's outgoing messages under one name: a header of counters, then the data.

    Header words: [0] the number of the last message published; from word LINE / 8 on, per
    reader j its acknowledged message number (a cache line each); then per destination d the
    (first, last) byte of its part of the message."""

    def __init__(self, path: str, world: int, create: bool):
        self.path, self.world = path, world
        self.header = -(-(LINE * (1 + world) + 16 * world) // PAGE) * PAGE
        if create:  # made whole under another name, then renamed: a peer never maps a short file
            making = f"{path}.making"
            self.fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self.fd, self.header + CAPACITY)
            os.rename(making, path)
        else:
            self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, self.header + CAPACITY)
        self.words = np.frombuffer(self.map, np.int64, count=self.header // 8)
        self.data = np.frombuffer(self.map, np.uint8, offset=self.header)
        self.address = self.words.ctypes.data
        self.reserved = 0
        self.linked = create  # the writer's to remove: a reader's unlink could come before another's open

    def counter(self, word: int) -> int:
        return _host_engine.load_acquire(self.address + 8 * word)

    def publish(self, word: int, value: int) -> None:
        _host_engine.store_release(self.address + 8 * word, value)

    def ack_word(self, reader: int) -> int:
        return LINE // 8 * (1 + reader)

    def part_words(self, destination: int) -> int:
        return LINE // 8 * (1 + self.world) + 2 * destination

    def reserve(self, nbytes: int) -> None:
        """Pages for nbytes of data taken now, where running out can still be reported."""
        if nbytes > CAPACITY:
            raise ValueError(f"hvd_aps: a host-level message of {nbytes} bytes exceeds the shared memory box's "
                             f"{CAPACITY} bytes: use smaller buckets (bucket_bytes)")
        if nbytes > self.reserved:
            try:
                os.posix_fallocate(self.fd, 0, self.header + nbytes)
            except OSError as err:
                raise RuntimeError(f"hvd_aps: {DIRECTORY} has no room for a {nbytes}-byte host-level message "
                                   f"({err.strerror}); give it more (docker run --shm-size=...), or pass "
                                   "hierarchical=False") from err
            self.reserved = nbytes

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self, unlink: bool = True) -> None:
        if unlink:
            self.unlink()
        del self.words, self.data
        self.map.close()
        os.close(self.fd)


class HostMemory(exchange.Eager):
    """Collectives among the ranks of one host (`pids` in local-rank order, this process at
    `rank`) through shared memory boxes; CUDA arrays through `fallback`. `job`: a token equal on
    every rank of the job and unique to it, `host`: this host's index (both name the files);
    `timeout`: seconds a collective waits for a peer before it raises."""

    equal_allgather = False

    def __init__(self, job: str, host: int, pids: Sequence[int], rank: int,
                 fallback: Optional[exchange.Collectives] = None, timeout: float = DEFAULT_TIMEOUT):
        self.job, self.host, self.pids = job, host, tuple(int(p) for p in pids)
        self.world, self.rank, self.fallback, self.timeout = len(self.pids), rank, fallback, timeout
        self._own, self._peers, self._sent, self._lock = {}, {}, {}, threading.Lock()
        sweep()

    def path(self, rank: int, name: str) -> str:
        return os.path.join(DIRECTORY, f"{PREFIX}.{self.job}.h{self.host}.{self.pids[rank]}.{_safe(name)}")

    # collectives -------------------------------------------------------------------------------
    def alltoall(self, send, splits, name):
        if _arrays.array_module(send) is not np:
            return self.fallback.alltoall(send, splits, name)
        return self._exchange(name, [send], self._bounds(send.dtype, splits))

    def alltoall_each(self, parts, splits, name, take):
        if _arrays.array_module(parts[0]) is not np:
            return self.fallback.alltoall_each(parts, splits, name, take)
        self._exchange(name, parts, self._bounds(parts[0].dtype, splits), take)

    def allgather(self, message, name):
        if _arrays.array_module(message) is not np:
            return self.fallback.allgather(message, name)
        return self._exchange(name, [message], [(0, message.nbytes)] * self.world)

    def allgather_each(self, message, name, take):
        if _arrays.array_module(message) is not np:
            return self.fallback.allgather_each(message, name, take)
        self._exchange(name, [message], [(0, message.nbytes)] * self.world, take)

    def max_allreduce(self, vector, name):
        if _arrays.array_module(vector) is not np:
            return self.fallback.max_allreduce(vector, name)
        return self.allgather(np.asarray(vector, np.float64), name).reshape(self.world, -1).max(axis=0)

    def _bounds(self, dtype: np.dtype, splits) -> list:
        """(first, last) byte of the message for each local rank, from its elements of `dtype`."""
        bounds = np.cumsum([0] + [int(s) for s in splits]) * np.dtype(dtype).itemsize
        return [(bounds[d], bounds[d + 1]) for d in range(self.world)]

    def _exchange(self, name: str, send: Sequence[np.ndarray], bounds: list,
                  take: Optional[Callable] = None) -> Optional[np.ndarray]:
        """Publish the arrays of `send` end to end (one dtype) with bounds[d] (the bytes for local
        rank d), then every rank's part for this one, concatenated in local-rank order, as an
        array of that dtype; or, with `take`, take(writer, its part) straight from the writer's
        box, before it is acknowledged."""
        box, count = self._outbox(name), self._sent.get(name, 0) + 1
        for reader in range(self.world):  # the last message must have been read before it is overwritten
            if reader != self.rank:
                self._wait(box, box.ack_word(reader), count - 1, reader, name)
        if count == 2:  # every peer has acknowledged a message, so has the box mapped: its name can go
            box.unlink()
        box.reserve(sum(a.nbytes for a in send))
        at = 0
        for array in send:  # each straight into the box: no concatenation first
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            box.data[at:at + raw.size] = raw
            at += raw.size
        for d, (lo, hi) in enumerate(bounds):
            box.words[box.part_words(d):box.part_words(d) + 2] = (lo, hi)
        box.publish(0, count)
        self._sent[name] = count
        boxes = [box if writer == self.rank else self._inbox(name, writer) for writer in range(self.world)]
        spans = []
        for writer, peer in enumerate(boxes):
            self._wait(peer, 0, count, writer, name)
            spans.append(peer.words[peer.part_words(self.rank):peer.part_words(self.rank) + 2])
        out = np.empty(sum(int(hi - lo) for lo, hi in spans), np.uint8) if take is None else None
        at = 0
        for writer, (peer, (lo, hi)) in enumerate(zip(boxes, spans)):
            if take is None:
                out[at:at + hi - lo] = peer.data[lo:hi]
                at += hi - lo
            else:
                take(writer, peer.data[lo:hi].view(send[0].dtype))
            if writer != self.rank:
                peer.publish(peer.ack_word(self.rank), count)
        return out.view(send[0].dtype) if take is None else None

    # boxes -------------------------------------------------------------------------------------
    def _outbox(self, name: str) -> _Box:
        with self._lock:
            if name not in self._own:
                self._own[name] = _Box(self.path(self.rank, name), self.world, create=True)
            return self._own[name]

    def _inbox(self, name: str, writer: int) -> _Box:
        """A peer's box, opened once it exists (its first message may not have been written yet)."""
        key = (name, writer)
        with self._lock:
            box = self._peers.get(key)
        if box is None:
            path = self.path(writer, name)
            self._until(lambda: os.path.exists(path), writer, name)
            box = _Box(path, self.world, create=False)
            with self._lock:
                self._peers[key] = box
        return box

    def _wait(self, box: _Box, word: int, value: int, peer: int, name: str) -> None:
        """Until the counter at `word` of `box` reaches `value`."""
        self._until(lambda: box.counter(word) >= value, peer, name)

    def _until(self, done: Callable[[], bool], peer: int, name: str) -> None:
        """Until done(), looking again after sleeps growing from POLL_FIRST to POLL_MAX; raises if
        local rank `peer`, whom this rank waits for, exits meanwhile or has not come after
        `timeout` seconds."""
        delay, checked = POLL_FIRST, time.monotonic()
        deadline = checked + self.timeout
        while not done():
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX)
            if time.monotonic() - checked >= LIVENESS_SECONDS:
                if not _alive(self.pids[peer]):
                    raise RuntimeError(f"hvd_aps: local rank {peer} of this host (pid {self.pids[peer]}) exited "
                                       f"while this rank waited for it in {name}")
                checked = time.monotonic()
                if checked >= deadline:
                    raise TimeoutError(f"hvd_aps: local rank {self.rank} had no answer from local rank {peer} of "
                                       f"this host (pid {self.pids[peer]}) for {self.timeout:g} s in {name} (shared "
                                       "memory): do all ranks run the same model and optimizer, with equal "
                                       "APSCompressor settings? The ranks of this host no longer agree on what "
                                       "their shared memory holds: restart the job (APSCompressor(timeout=...) "
                                       "sets this wait)")

    def close(self, wait: float = CLOSE_SECONDS) -> None:
        """Unmap every box and remove this rank's files, once every peer has read the last message
        (up to `wait` seconds: a peer may not have opened the box yet, and a file removed before
        it does can never be found). A box still unread is left for the sweep of a later job."""
        with self._lock:
            own, peers, sent = self._own, list(self._peers.values()), self._sent
            self._own, self._peers, self._sent = {}, {}, {}
        deadline = time.monotonic() + wait
        for name, box in own.items():
            box.close(unlink=self._read(box, sent.get(name, 0), deadline))
        for box in peers:
            box.close()

    def _read(self, box: _Box, count: int, deadline: float) -> bool:
        """Whether every peer still running acknowledged message `count` of `box` by `deadline`."""
        waiting = [r for r in range(self.world) if r != self.rank]
        while True:
            waiting = [r for r in waiting if box.counter(box.ack_word(r)) < count and _alive(self.pids[r])]
            if not waiting or time.monotonic() >= deadline:
                return not waiting
            time.sleep(POLL_MAX)

    def __del__(self):
        if getattr(self, "_own", None):
            self.close(wait=0.0)


def place() -> tuple:
    """This process's (pid, a fresh token): what connect() needs of every rank, gathered with its
    host and local rank (the token of the group's first rank names the job's files)."""
    return os.getpid(), secrets.token_hex(6)


def connect(topology, places: list, rank: int, allgather_object: Callable,
            fallback: Optional[exchange.Collectives] = None, timeout: float = DEFAULT_TIMEOUT) -> Optional[HostMemory]:
    """HostMemory for `rank`'s host (ranks numbered as in `places`, each place ending in
    place()'s pair) where every rank of it sees the others' files in /dev/shm, else None (with a
    warning where it was possible but the ranks do not share a /dev/shm: containers with one
    hostname on different machines). Collective: every rank of the group calls it together."""
    local = topology.local_group(rank)
    memory = HostMemory(places[0][-1], topology.hosts.index(local), [places[r][-2] for r in local],
                        local.index(rank), fallback, timeout)
    probe = memory.path(memory.rank, "probe") if available() else None
    if probe:
        open(probe, "w").close()
    try:
        allgather_object(None)  # every probe written
        seen = bool(probe) and all(os.path.exists(memory.path(j, "probe")) for j in range(memory.world))
        shared = all(allgather_object(seen))
    finally:
        if probe:
            os.unlink(probe)
    if shared:
        return memory
    if available():
        warnings.warn("hvd_aps: the ranks of a host do not share /dev/shm, so float32 inside the host goes "
                      "through the framework's collectives", RuntimeWarning, stacklevel=3)
    return None


def stale() -> list:
    """The names of the boxes in DIRECTORY whose process no longer runs (a job that died before
    its boxes were unlinked)."""
    try:
        names = os.listdir(DIRECTORY)
    except OSError:
        return []
    return [name for name in names if (match := _FILE.match(name)) and not _alive(int(match[1]))]


def sweep() -> None:
    """Remove stale() boxes."""
    for name in stale():
        try:
            os.unlink(os.path.join(DIRECTORY, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: exists, and is no zombie (exited, its parent not yet told)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # no /proc: kill's answer stands
        return True


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
