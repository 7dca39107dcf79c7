"""Launch a worker script with real Horovod processes and load what each rank saved."""
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKERS = pathlib.Path(__file__).parent / "workers"
BIN = os.path.dirname(sys.executable)  # .venv/bin: horovodrun, and mpirun where MPICH came from PyPI


def horovodrun(script, tmp_path, ranks=2, timeout=240, args=(), gloo=True):
    """horovodrun with Gloo (--gloo), or with gloo=False as horovodrun picks by itself: MPI where
    Horovod has it (through the mpirun on PATH: this Python's, first)."""
    horovodrun = shutil.which("horovodrun", path=BIN)
    if horovodrun is None:
        pytest.fail("horovodrun is not installed next to this Python: run scripts/install.sh")
    cmd = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", *(["--gloo"] if gloo else []),
           sys.executable, str(WORKERS / script), *args, str(tmp_path)]
    return _run(cmd, timeout)


def mpirun(script, tmp_path, ranks=2, timeout=240, args=()):
    """`mpirun -np N python ...` as an MPI user types it: no Horovod launcher at all."""
    mpirun = shutil.which("mpirun", path=BIN) or shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("no mpirun: scripts/install.sh installs MPICH into .venv (HVD_APS_MPI)")
    return _run([mpirun, "-np", str(ranks), sys.executable, str(WORKERS / script), *args, str(tmp_path)], timeout)


def _run(cmd, timeout):
    env = dict(os.environ, PYTHONPATH=str(WORKERS), TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([BIN, os.environ.get("PATH", "")]))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run


def load(tmp_path, prefix, ranks=2):
    return [dict(np.load(tmp_path / f"{prefix}_rank{r}.npz")) for r in range(ranks)]


def free_port():
    """A TCP port on loopback nothing listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
