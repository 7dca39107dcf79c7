"""The Dockerfiles may only install OS packages and call the project's installer, which CI runs."""
import pathlib
import re
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).parent.parent


def test_dockerfiles_only_call_the_installer():
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "docker" / name).read_text()
        runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, flags=re.M | re.S)
        assert runs, name
        for run in runs:
            assert run.startswith("apt-get") or re.fullmatch(r"(HVD_APS_DEVICE=\w+ )?bash scripts/install.sh", run), run
        assert "scripts/install.sh" in text


def test_wheel_holds_the_kernel_sources_and_the_host_engine(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("hvd_aps-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hvd_aps/ops/fpcodec.h" in names and "hvd_aps/ops/host.c" in names
    assert any(re.fullmatch(r"hvd_aps/_hostcodec\..*so", n) for n in names), names
