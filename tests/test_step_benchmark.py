"""examples/gpu_step_benchmark.py, which the GPU machine's one short run spends three minutes on
(scripts/gpu_check.sh), runs through on the CPU first: its smoke run (tiny shapes, Gloo, world 1,
no torchrun) prints a row for every variant of every model and writes them all to its JSON, so a
bug in it costs no device time."""
import json
import os
import pathlib
import re
import sys

from horovod_run import bounded

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "gpu_step_benchmark.py"
DDP_ROWS = ["ddp", "ddp+bf16_hook", "ddp+aps_hook"]
ROWS = {"resnet50": DDP_ROWS, "gpt2": DDP_ROWS, "linear8192": DDP_ROWS, "fsdp-gpt2": ["fsdp2", "fsdp2+aps"]}
SMOKE_SECONDS = 30  # about 7 s on two shared cores
SMOKE_TIMED_STEPS = 4  # --smoke's 2 rounds of 2 steps


def test_the_smoke_run_prints_every_variant_and_writes_its_json(tmp_path):
    out = tmp_path / "smoke.json"
    run = bounded([sys.executable, EXAMPLE, "--device", "cpu", "--smoke", "--out", out], SMOKE_SECONDS,
                  dict(os.environ, OMP_NUM_THREADS="1"))
    for model, labels in ROWS.items():
        for label in labels:
            row = rf"^{model}\s+{re.escape(label)}\s+\d+\.\d+\s+\d+\.\d+\s"
            assert re.search(row, run.stdout, re.M), f"no row for {model} {label}:\n{run.stdout}"
    assert "targets: " in run.stdout
    models = json.loads(out.read_text())["models"]
    assert {m: [v["label"] for v in r["variants"].values()] for m, r in models.items()} == ROWS
    for model, result in models.items():
        for name, row in result["variants"].items():
            assert 0 < row["floor_ms"] <= row["median_ms"] and row["timed_steps"] == SMOKE_TIMED_STEPS
            assert "error" not in row["profile"], row["profile"]
            if name == "aps":  # judged where codes ran (FSDP2 makes no reduce-scatter at world 1)
                coded = row["profile"]["coded_elements"]
                assert model == "fsdp-gpt2" or coded == result["parameters"], row
                assert (row["target"]["met"] is None) == (coded == 0), row
