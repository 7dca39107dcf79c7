"""Launch worker scripts as real processes (horovodrun, mpirun, torchrun) and load what each rank
saved. Every launch is bounded: a job still running at its bound has each of its Python processes
print all its threads' stacks (faulthandler, on SIGABRT) before it is killed, and the test fails
with them, so a hang explains itself."""
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

WORKERS = pathlib.Path(__file__).parent / "workers"
BIN = os.path.dirname(sys.executable)  # .venv/bin: horovodrun, and mpirun where MPICH came from PyPI
STACKS_S = 5  # how long a job's processes get to print their stacks, and its launcher to pass them on
TAIL = 12_000  # characters of a failed job's output and error shown
FRAMES = 80     # lines of the frames digest a hung job's failure ends with
_OURS = re.compile(r'(\[\d+\]<std\w+>:)?\s*File "[^"]*(hvd_aps|horovod|workers)[^"]*", line \d+ in \w+')


def worker_env(**extra) -> dict:
    """The environment workers run in: tests/workers importable (before the PYTHONPATH given), one
    thread for OpenMP, TF quiet, this Python's bin first on PATH, faulthandler on (the stacks a
    bounded launch asks for)."""
    path = [str(WORKERS), str(WORKERS.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
                PYTHONFAULTHANDLER="1", PATH=os.pathsep.join([BIN, os.environ.get("PATH", "")]), **extra)


def bounded(cmd, timeout: float, env: dict = None, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
    """Run `cmd` to its end within `timeout` seconds. Past it, every Python process of the job
    prints its threads' stacks (the workers first, then the launcher, which passes theirs on), the
    job is killed, and the test fails showing them. check: a non-zero exit fails the test too."""
    env = dict(env if env is not None else worker_env(), PYTHONFAULTHANDLER="1")
    started = time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = (_quiet(text) for text in _stacks_then_kill(proc))
        pytest.fail(f"{' '.join(map(str, cmd))} ran past its bound of {timeout:.0f} s; each process's stacks:\n"
                    f"{out[-TAIL:]}\n{err[-TAIL:]}\n{_frames(out + err)}")
    run = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    run.pid = proc.pid  # what the job may have named things it made after
    if check:
        assert run.returncode == 0, (f"{' '.join(map(str, cmd))} failed (rc {run.returncode}, "
                                     f"{time.monotonic() - started:.0f} s):\n{out[-TAIL:]}\n{err[-TAIL:]}")
    return run


def _frames(text: str) -> str:
    """The frames of hvd_aps, Horovod and the workers in the stacks, each once: last in a hung
    job's failure, where a log cut in its middle still shows where the job waited."""
    seen = list(dict.fromkeys(m.group(0) for m in _OURS.finditer(text)))
    return "frames of hvd_aps, Horovod and the workers in those stacks:\n" + "\n".join(seen[-FRAMES:])


def _stacks_then_kill(proc: subprocess.Popen) -> tuple:
    """SIGABRT to the job's Python processes, deepest first (faulthandler prints their stacks), then
    SIGKILL to its session; what it printed."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    pythons = [p for p in family if _is_python(p)]
    for p in pythons:
        _signal(p, signal.SIGABRT)
    time.sleep(STACKS_S)
    _signal(psutil.Process(proc.pid) if psutil.pid_exists(proc.pid) else None, signal.SIGABRT)
    time.sleep(1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        _signal(p, signal.SIGKILL)
    try:
        return proc.communicate(timeout=STACKS_S)  # the session killed: its pipes close
    except subprocess.TimeoutExpired as held:  # a process outside it holds them: what was read
        return tuple(text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                     for text in (held.stdout, held.stderr))


# what killing horovodrun's helper processes makes multiprocessing's resource tracker print, once each
_TRACKER_NOISE = re.compile(r"Traceback \(most recent call last\):\n  File \S+resource_tracker\.py\S*, line \d+, in main\n"
                            r"    cache\[rtype\]\.remove\(name\)\nKeyError: '/mp-\w+'\n")


def _quiet(text: str) -> str:
    return _TRACKER_NOISE.sub("", text)


def _is_python(process: psutil.Process) -> bool:
    try:
        return "python" in os.path.basename(process.exe() or process.name())
    except psutil.Error:
        return False


def _signal(process, sig) -> None:
    if process is None:
        return
    try:
        process.send_signal(sig)
    except psutil.Error:
        pass


def horovodrun(script, tmp_path, ranks=2, timeout=240, args=(), gloo=True, env=None):
    """horovodrun with Gloo (--gloo), or with gloo=False as horovodrun picks by itself: MPI where
    Horovod has it (through the mpirun on PATH: this Python's, first)."""
    horovodrun = shutil.which("horovodrun", path=BIN)
    if horovodrun is None:
        pytest.fail("horovodrun is not installed next to this Python: run scripts/install.sh")
    cmd = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", *(["--gloo"] if gloo else []),
           sys.executable, str(WORKERS / script), *args, str(tmp_path)]
    return bounded(cmd, timeout, env)


def mpirun(script, tmp_path, ranks=2, timeout=240, args=()):
    """`mpirun -np N python ...` as an MPI user types it: no Horovod launcher at all."""
    mpirun = shutil.which("mpirun", path=BIN) or shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("no mpirun: scripts/install.sh installs MPICH into .venv (HVD_APS_MPI)")
    return bounded([mpirun, "-np", str(ranks), sys.executable, str(WORKERS / script), *args, str(tmp_path)], timeout)


def torchrun(script, *args, ranks=2, timeout=240, env=None, check=True):
    """`python -m torch.distributed.run` on loopback: `ranks` processes of a worker script (a path,
    or a name under tests/workers) with a rendezvous port of its own."""
    script = script if os.path.isabs(str(script)) else WORKERS / script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args)]
    return bounded(cmd, timeout, env, check)


def load(tmp_path, prefix, ranks=2):
    return [dict(np.load(tmp_path / f"{prefix}_rank{r}.npz")) for r in range(ranks)]


def free_port():
    """A TCP port on loopback nothing listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
