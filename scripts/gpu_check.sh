#!/usr/bin/env bash
# Everything the GPU machine should run in one go (docs/gpu.md): the CUDA tests, the codec and
# exchange benchmarks on the device, Nsight Compute on the exchange's kernels, compute-sanitizer.
# Writes every result under $OUT (default ./gpu-results). Nothing is fetched: run it from a copy
# of the repository on a machine with torch, CuPy, pytest and ml_dtypes installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
run() { echo "== $*" | tee -a "$OUT/log.txt"; "$@" >>"$OUT/log.txt" 2>&1; echo "rc=$?" | tee -a "$OUT/log.txt"; }

run nvidia-smi
run $PY setup.py -q build_ext --inplace
run $PY -m pytest -q tests/test_gpu.py tests/test_kernel_build.py tests/test_codec_oracle.py
run $PY examples/benchmark_codec.py --device cuda --repeats 20
cp "$OUT/log.txt" "$OUT/log-after-codec.txt"
(cd examples && run $PY benchmark_exchange.py --device cuda --model resnet50 --workers 8)
(cd examples && run $PY benchmark_exchange.py --device cuda --model transformer-1b --workers 8 --formats e4m3)
if command -v ncu >/dev/null; then
  run ncu --target-processes all -k regex:hvd_ --launch-count 12 --set full -o "$OUT/kernels" \
      $PY examples/benchmark_codec.py --device cuda --repeats 1
fi
if command -v compute-sanitizer >/dev/null; then
  run compute-sanitizer --tool memcheck $PY -m pytest -q -x tests/test_gpu.py -k "blocked or packed_row"
  run compute-sanitizer --tool racecheck $PY -m pytest -q -x tests/test_gpu.py -k "blocked"
fi
echo "results in $OUT"
