"""The accuracy study's quick mode under 2 real ranks, through Horovod (horovodrun) and through
torch.distributed DDP (torchrun), on both tasks: APS e4m3 must train like fp32, the naive e4m3
cast measurably worse, 4-bit codes with error feedback (digits) or hybrid precision (the
transformer) close to fp32, with parameters identical on every rank."""
import json
import os
import pathlib
import shutil
import sys

import pytest

from horovod_run import bounded, torchrun

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "accuracy_study.py"
pytestmark = pytest.mark.slow  # minutes of training: .ci/run and scripts/soak.sh run it (pytest.ini)


def launch(kind, out, task="digits"):
    args = ["--task", task, "--quick", "--out", out]
    if kind == "horovod":
        horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
        assert horovodrun, "horovodrun is not installed next to this Python: run scripts/install.sh"
        bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, EXAMPLE, *args], 600)
    else:
        torchrun(EXAMPLE, "--ddp", *args, timeout=600)
    folder = out / f"{task}-{kind}-2"
    assert json.loads((folder / "checks.json").read_text())["parameters_identical_on_all_ranks"] is True
    assert (folder / "curves.png").stat().st_size > 10_000 and (folder / "results.csv").exists()
    return json.loads((folder / "results.json").read_text())["summary"]


def close_to_fp32(ours, fp32):
    """Stated tolerance: within 1.5 points of test accuracy and 10 % of training loss."""
    assert abs(ours["final_test_accuracy_mean"] - fp32["final_test_accuracy_mean"]) <= 0.015
    assert ours["final_train_loss_mean"] <= 1.10 * fp32["final_train_loss_mean"]


def measurably_worse(naive, fp32):
    """At least twice the loss and 5 points of accuracy lost."""
    assert naive["final_train_loss_mean"] >= 2 * fp32["final_train_loss_mean"]
    assert naive["final_test_accuracy_mean"] <= fp32["final_test_accuracy_mean"] - 0.05


@pytest.mark.parametrize("kind", ["horovod", "ddp"])
def test_quick_study(tmp_path, kind):
    summary = launch(kind, tmp_path)
    fp32, codes, naive = summary["none"], summary["aps-e4m3"], summary["naive-e4m3"]
    close_to_fp32(codes, fp32)
    measurably_worse(naive, fp32)
    assert codes["bytes_per_step_per_worker"] < 0.26 * fp32["bytes_per_step_per_worker"]
    if kind == "horovod":  # the float16 carrier, through Horovod's own allreduce
        values = summary["aps-e4m3-values"]
        close_to_fp32(values, fp32)
        assert values["bytes_per_step_per_worker"] * 2 == fp32["bytes_per_step_per_worker"]
        # 4-bit codes with error feedback: final loss within 5 % of fp32's (without it, this quick
        # run ends 12-22 % above fp32)
        for setting in ("codes-e3m0-ef", "codes-e2m1fn-ef"):
            assert summary[setting]["final_train_loss_mean"] <= 1.05 * fp32["final_train_loss_mean"]
        assert summary["codes-e3m0-ef"]["bytes_per_step_per_worker"] < 0.13 * fp32["bytes_per_step_per_worker"]


def test_quick_transformer_study(tmp_path):
    """AdamW on the byte-level transformer, 2 Horovod ranks, 112 steps: APS e4m3 within 1 % of
    fp32's loss, the naive cast at least 2 % over, e3m0 with hybrid precision within 2 % while
    sending less than e4m3 (measured in this quick run: +0.03 %, +3.3 %, +0.5 % at 0.61x of
    e4m3's bytes)."""
    summary = launch("horovod", tmp_path, "transformer")
    fp32 = summary["none"]["final_train_loss_mean"]
    loss = {s: r["final_train_loss_mean"] / fp32 for s, r in summary.items()}
    assert loss["aps-e4m3"] <= 1.01 and loss["naive-e4m3"] >= 1.02 and loss["codes-e3m0-hybrid"] <= 1.02
    assert summary["codes-e3m0-hybrid"]["bytes_per_step_per_worker"] < summary["aps-e4m3"]["bytes_per_step_per_worker"]
