#!/usr/bin/env bash
# Everything the GPU machine should run in one go (docs/gpu.md), most important first, each step
# bounded in time so one that hangs leaves the rest their turn: the CUDA tests (the CuPy engine bit
# for bit against the CPU, the DDP hook over NCCL with one rank and over Gloo with two ranks on the
# one GPU, the calibration's mirrored ranks), the performance model's GPU codec
# (`calibrate --device cuda`), the codec and exchange benchmarks on the device, Nsight Compute on the
# exchange's kernels, compute-sanitizer. Writes every result under $OUT (default ./gpu-results).
# Nothing is fetched: run it from a copy of the repository on a machine with torch, CuPy, pytest and
# ml_dtypes installed. `GPU_CHECK_STEPS="tests calibrate"` runs only the named steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-"tests calibrate codec exchange ncu sanitizer"}
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
# run SECONDS COMMAND...: the command's output into the log, its exit status and time after it
run() {
  local limit=$1; shift
  echo "== $* (at most ${limit}s)" | tee -a "$log"
  local started=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "rc=$? in $((SECONDS - started))s" | tee -a "$log"
}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

run 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
run 20 $PY -c "import torch, cupy, numpy, ml_dtypes; print(torch.__version__, cupy.__version__, numpy.__version__, ml_dtypes.__version__)"
# This copy, installed (scripts/install.sh), is used as it is. Uninstalled (the GPU machine, where
# pip's build step would fetch its build dependencies), it is installed without pip: the C engine
# built in place, ops/ seen as hvd_aps.ops as the wheel ships it, and the copy on the interpreter's
# path for the processes torchrun starts (a .pth file in its site-packages, as an editable install
# writes).
if ! (cd / && $PY -c "import sys, hvd_aps.ops; sys.exit(hvd_aps.__file__ != sys.argv[1])" "$PWD/hvd_aps/__init__.py") 2>/dev/null; then
  run 90 $PY setup.py -q build_ext --inplace
  [ -e hvd_aps/ops ] || ln -s ../ops hvd_aps/ops
  run 20 $PY -c "import site, sys; open(site.getsitepackages()[0] + '/hvd_aps_checkout.pth', 'w').write(sys.argv[1])" "$PWD"
fi
if wanted tests; then
  run 240 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel_build.py --junitxml "$OUT/gpu-tests.xml"
fi
if wanted calibrate; then
  run 120 $PY -m hvd_aps calibrate --device cuda --world 8 --out "$OUT/calibration_gpu.json"
fi
if wanted codec; then
  run 120 $PY examples/benchmark_codec.py --device cuda --repeats 10
fi
if wanted exchange; then
  run 90 $PY examples/benchmark_exchange.py --device cuda --model resnet50 --workers 8
fi
if wanted ncu && command -v ncu >/dev/null; then
  # the table kernels, at 64 MiB (benchmark_codec's packed-row stages)
  run 90 ncu --target-processes all -k regex:"hvd_table_(encode|sum|decode)" --launch-count 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section ComputeWorkloadAnalysis \
      $PY examples/benchmark_codec.py --device cuda --repeats 1
fi
if wanted sanitizer && command -v compute-sanitizer >/dev/null; then
  run 120 compute-sanitizer --tool memcheck $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu.py -k "blocked or packed_row or table_stages"
  run 90 compute-sanitizer --tool racecheck $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu.py -k "blocked and e4m3"
fi
echo "results in $OUT"
