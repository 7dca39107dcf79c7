#!/usr/bin/env bash
# Everything the GPU machine should run in one call (docs/gpu.md), most important first, within
# GPU_CHECK_BUDGET_S seconds (default 330: a call gets 6 minutes of device time, the machine's
# start besides). Each step is bounded by `timeout` and by what is left of the budget, so one that
# hangs leaves the rest their turn, and a step with too little time left is skipped, not started:
#   build      the C engine in place, nothing fetched (only where the copy is not installed)
#   tests      the CUDA tests: the CuPy engine bit for bit against the CPU (and the stats' sums against
#              the kernels' emulation on the CPU), the exchange on CuPy arrays, the DDP hook over NCCL
#              with one rank and over Gloo with two on the one GPU
#   calibrate  the GPU codec for the performance model (calibration_gpu.json: `plan --device cuda
#              --calibration` takes it in place of the projection), printed beside the projection
#   bench      examples/gpu_step_benchmark.py under torchrun, world 1 over NCCL: DDP's step with no
#              hook, bf16_compress_hook and aps_hook, FSDP2 alone and with hvd_aps.fsdp.apply, their
#              ratios against the targets, the profiler's synchronisation and launch counts per step
#   codec      examples/benchmark_codec.py, short: encode/decode against a copy and torch's cast
#   sanitizer  compute-sanitizer memcheck and racecheck over the block-table and packed-row tests
#   ncu        Nsight Compute on the table kernels
# Named only: `exchange` (8 emulated workers).
# GPU_CHECK_STEPS="tests bench" runs only the named steps; GPU_CHECK_BENCH_ARGS adds arguments to
# the benchmark (e.g. "--models gpt2 fsdp-gpt2"). Writes under $OUT (default ./gpu-results), at
# most 4 files: log.txt, gpu-tests.xml, step_benchmark.json, calibration_gpu.json. Run it from a
# copy of the repository on a machine with torch, CuPy, pytest and ml_dtypes installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=$(command -v "${PYTHON:-python3}")
[[ $PY == /* ]] || PY=$PWD/$PY  # the install check below runs it from /
STEPS=${GPU_CHECK_STEPS:-"tests calibrate bench codec sanitizer ncu"}
BUDGET=${GPU_CHECK_BUDGET_S:-330}
MIN_STEP_S=20  # a step with less than this left of the budget is skipped
KILL_AFTER_S=10  # after its limit a step gets this long to exit on its signal before SIGKILL
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
log="$OUT/log.txt"
# [SIG=INT] run SECONDS COMMAND...: the command's output into the log, bounded by SECONDS and the
# budget left, then its exit status and time. SIG=INT for pytest, which still writes its junit
# report when interrupted; TERM otherwise (torchrun passes it on to the benchmark, whose threads'
# stacks then go to the log).
run() {
  local limit=$1 left=$((BUDGET - SECONDS)); shift
  (( limit > left )) && limit=$left
  if (( limit < MIN_STEP_S )); then
    echo "== skipped, ${left}s of the budget left: $*" | tee -a "$log"
    return 0
  fi
  echo "== $* (at most ${limit}s, ${left}s of the budget left)" | tee -a "$log"
  local started=$SECONDS
  timeout -s "${SIG:-TERM}" -k "$KILL_AFTER_S" "$limit" "$@" >>"$log" 2>&1
  echo "rc=$? in $((SECONDS - started))s" | tee -a "$log"
}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

run 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
run 30 $PY -c "import torch, cupy, numpy, ml_dtypes; print(torch.__version__, torch.version.cuda, cupy.__version__, numpy.__version__, ml_dtypes.__version__)"
# This copy, installed (scripts/install.sh), is used as it is. Uninstalled (the GPU machine, where
# pip's build step would fetch its build dependencies), it is installed without pip: the C engine
# built in place, ops/ seen as hvd_aps.ops as the wheel ships it, and the copy on the interpreter's
# path for the processes torchrun starts (a .pth file in its site-packages, as an editable install
# writes).
# (the checkout's path taken before `cd /`, where $PWD would be /)
if ! (root=$PWD; cd / && $PY -c "import sys, hvd_aps.ops; sys.exit(hvd_aps.__file__ != sys.argv[1])" "$root/hvd_aps/__init__.py") 2>/dev/null; then
  run 60 $PY setup.py -q build_ext --inplace
  [ -e hvd_aps/ops ] || ln -s ../ops hvd_aps/ops
  run 20 $PY -c "import site, sys; open(site.getsitepackages()[0] + '/hvd_aps_checkout.pth', 'w').write(sys.argv[1])" "$PWD"
fi
if wanted tests; then
  SIG=INT run 90 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel_build.py \
      --junitxml "$OUT/gpu-tests.xml"
fi
if wanted calibrate; then
  run 90 $PY -m hvd_aps calibrate --device cuda --world 8 --out "$OUT/calibration_gpu.json"
  run 20 $PY examples/gpu_projection.py --against "$OUT/calibration_gpu.json"
fi
if wanted bench; then
  # ~3 minutes at the benchmark's default pace (30 warm-up steps and more until settled, 6 rounds
  # of 5 timed steps, 3 profiled and 3 checked steps a variant); it rewrites its JSON after each model
  run 180 $PY -m torch.distributed.run --standalone --nproc_per_node 1 examples/gpu_step_benchmark.py \
      --out "$OUT/step_benchmark.json" ${GPU_CHECK_BENCH_ARGS:-}
fi
if wanted codec; then
  run 45 $PY examples/benchmark_codec.py --device cuda --repeats 3
fi
if wanted sanitizer && command -v compute-sanitizer >/dev/null; then
  # the block-table kernels (what the exchange launches) first, then the packed-row ones
  SIG=INT run 60 compute-sanitizer --tool memcheck $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu.py \
      -k "table or blocked or packed_row"
  SIG=INT run 45 compute-sanitizer --tool racecheck $PY -m pytest -q -p no:cacheprovider -x tests/test_gpu.py \
      -k "(table or blocked) and e4m3"
fi
if wanted ncu && command -v ncu >/dev/null; then
  # the table kernels at 64 MiB (benchmark_codec's packed-row stages)
  run 60 ncu --target-processes all -k regex:"hvd_table_(encode|sum|decode)" --launch-count 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section ComputeWorkloadAnalysis \
      $PY examples/benchmark_codec.py --device cuda --repeats 1
fi
if wanted exchange; then
  run 90 $PY examples/benchmark_exchange.py --device cuda --model resnet50 --workers 8
fi
echo "results in $OUT after ${SECONDS}s of a ${BUDGET}s budget" | tee -a "$log"
