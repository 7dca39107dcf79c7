import os
import sys

import numpy as np
import pytest

import hvd_aps
from horovod_run import bounded

PROCESS_S = 120  # a CLI run or an interpreter's imports


def run_cli(*args):
    out = bounded([sys.executable, "-m", "hvd_aps", *args], PROCESS_S, env=dict(os.environ))
    return out.stdout


def test_formats_table():
    out = run_cli("formats")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert rows["e4m3"][1:4] == ["8", "ieee", "240"] and rows["e4m3"][-1] == "float8_e4m3"
    assert rows["e4m3fn"][3] == "448" and rows["e3m0"][-1] == "-"
    assert rows["fp16"][3] == "65504"


def test_probe_table():
    out = run_cli("probe", "--format", "e4m3", "--ranks", "4", "--size", "5000")
    rows = [line.split() for line in out.splitlines() if line.startswith("e4m3")]
    assert [(r[1], r[2]) for r in rows] == [("aps", "fp32"), ("aps", "format"), ("none", "fp32"), ("none", "format")]
    assert float(rows[0][3]) < 0.03 and float(rows[2][3]) == 1.0


def test_cli_rejects_bad_format():
    out = bounded([sys.executable, "-m", "hvd_aps", "probe", "--format", "e9m9"], PROCESS_S, env=dict(os.environ),
                  check=False)
    assert out.returncode != 0 and "exp_bits must be in 1..8" in out.stderr


def test_codec_bad_input():
    with pytest.raises(TypeError, match="numeric array"):
        hvd_aps.encode(np.array(["a", "b"]), "e4m3")
    with pytest.raises(ValueError, match="rounding"):
        hvd_aps.encode(np.zeros(3), "e4m3", rounding="up")
    with pytest.raises(TypeError, match="seed"):
        hvd_aps.encode(np.zeros(3), "e4m3", rounding="stochastic", seed="x")
    with pytest.raises(ValueError, match="shift"):
        hvd_aps.encode(np.zeros(3), "e4m3", shift=1.5)
    with pytest.raises(ValueError, match="cannot have produced"):
        hvd_aps.decode(np.array([16], np.uint8), "e2m1fn")
    with pytest.raises(TypeError, match="unsigned integer"):
        hvd_aps.decode(np.zeros(3, np.float32), "e4m3")
    with pytest.raises(ValueError, match="need 2 bytes"):
        hvd_aps.unpack(np.zeros(1, np.uint8), "e2m1fn", 3)
    with pytest.raises(ValueError, match="unknown format"):
        hvd_aps.encode(np.zeros(3), "float8")


def test_import_pulls_in_no_framework():
    code = "import sys, hvd_aps; print(any(m in sys.modules for m in ('torch', 'tensorflow')))"
    out = bounded([sys.executable, "-c", code], PROCESS_S, env=dict(os.environ))
    assert out.stdout.strip() == "False"


def test_the_ddp_hook_needs_no_horovod():
    code = "import sys, hvd_aps.ddp; print('horovod' in sys.modules)"
    out = bounded([sys.executable, "-c", code], PROCESS_S, env=dict(os.environ))
    assert out.stdout.strip() == "False"


def test_codec_threads_share_the_cores_between_the_ranks_on_a_machine(monkeypatch):
    from hvd_aps import _host_engine
    cores = len(os.sched_getaffinity(0))
    for var in ("HVD_APS_THREADS",) + _host_engine._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert _host_engine._thread_count() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert _host_engine._thread_count() == max(1, cores // 2)
    monkeypatch.setenv("HVD_APS_THREADS", "1")
    assert _host_engine._thread_count() == 1
    monkeypatch.setenv("HVD_APS_THREADS", str(cores + 5))  # never more than the cores
    assert _host_engine._thread_count() == cores


@pytest.mark.parametrize("var, value, words", [
    ("HVD_APS_THREADS", "abc", "HVD_APS_THREADS must be a number of threads"),
    ("HVD_APS_THREADS", "0", "HVD_APS_THREADS must be a number of threads"),
    ("HVD_APS_HOST_MEMORY", "2", "HVD_APS_HOST_MEMORY must be 0"),
    ("HVD_APS_ENGINE", "fast", "HVD_APS_ENGINE must be one of .'auto', 'host', 'numpy'."),
    ("HVD_APS_LINK", "fast", "HVD_APS_LINK is a link rate")])
def test_environment_variables_with_bad_values_are_refused_by_name(monkeypatch, var, value, words):
    from hvd_aps import _host_engine, _host_memory, calibration, codec
    monkeypatch.setenv(var, value)
    read = {"HVD_APS_THREADS": _host_engine._thread_count, "HVD_APS_HOST_MEMORY": _host_memory.available,
            "HVD_APS_ENGINE": codec._engine, "HVD_APS_LINK": calibration.job_link}[var]
    with pytest.raises(ValueError, match=words):
        read()
