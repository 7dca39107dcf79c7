"""ops/kernels.cu must compile for the GPUs hvd_aps targets (CI has nvcc but no GPU)."""
import pathlib
import shutil
import subprocess

import pytest

OPS = pathlib.Path(__file__).parent.parent / "ops"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    run = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "--cubin", "-Werror", "all-warnings",
                          "-o", str(tmp_path / "k.cubin"), str(OPS / "kernels.cu")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 10_000
