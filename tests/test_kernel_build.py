"""ops/kernels.cu must compile for the GPUs hvd_aps targets (CI has nvcc but no GPU), and define
every kernel the CuPy engine launches: one per table function of codec's engine contract, and no
other."""
import pathlib
import re
import shutil
import subprocess

import pytest

OPS = pathlib.Path(__file__).parent.parent / "ops"
ENGINE = pathlib.Path(__file__).parent.parent / "hvd_aps" / "_cupy_engine.py"
NVCC_S = 600  # nvcc compiling every kernel for one architecture
TABLE_KERNELS = {"hvd_table_amax", "hvd_table_encode", "hvd_table_sum", "hvd_table_decode", "hvd_table_shifts",
                 "hvd_table_stats"}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    run = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "--cubin", "-Werror", "all-warnings",
                          "-o", str(tmp_path / "k.cubin"), str(OPS / "kernels.cu")], capture_output=True, text=True,
                         timeout=NVCC_S)
    assert run.returncode == 0, run.stderr
    cubin = (tmp_path / "k.cubin").read_bytes()
    assert len(cubin) > 10_000
    launched = set(re.findall(r'"(hvd_[a-z0-9_]+)"', ENGINE.read_text()))
    assert launched == TABLE_KERNELS
    defined = set(re.findall(r'extern "C" __global__ void (hvd_[a-z0-9_]+)', (OPS / "kernels.cu").read_text()))
    assert defined == TABLE_KERNELS, f"kernels the CuPy engine does not launch: {sorted(defined - launched)}"
    missing = [name for name in launched if name.encode() + b"\0" not in cubin]  # extern "C": names as written
    assert not missing, f"the CuPy engine launches kernels kernels.cu does not define: {missing}"
