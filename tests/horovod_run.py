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


def horovodrun(script, tmp_path, ranks=2, timeout=240, args=()):
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    if horovodrun is None:
        pytest.fail("horovodrun is not installed next to this Python: run scripts/install.sh")
    env = dict(os.environ, PYTHONPATH=str(WORKERS), TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    cmd = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
           sys.executable, str(WORKERS / script), *args, str(tmp_path)]
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
