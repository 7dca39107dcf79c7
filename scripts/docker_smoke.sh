#!/usr/bin/env bash
# Build an image and run the 2-rank demo inside it; print the image size and the demo's accuracy;
# exit non-zero on any failure. Not part of CI (it takes minutes).
#
#   bash scripts/docker_smoke.sh [--gpu] [--torch-index URL] [--wheels DIR]
#
# Without --gpu: the CPU image (docker/Dockerfile.cpu); with it, the GPU image (docker/Dockerfile),
# whose demo runs on the CPU where the host has no GPU (torch's CUDA build runs there too).
# --torch-index: for the CPU image, an index of CPU-only torch wheels
# (https://download.pytorch.org/whl/cpu). --wheels: a directory of wheels pip may take first
# (torch's CPU wheel where that index is out of reach, or wheels downloaded once for repeated
# builds), served from this host on loopback for the build only (PIP_FIND_LINKS; nothing of it
# stays in the image but what pip installs). After the build it runs the 2-rank demo with Gloo and
# with MPI (the container given SYS_PTRACE: MPICH copies between a host's ranks with
# process_vm_readv, which Docker's default profile refuses).
#
# Needs a running Docker daemon. Where the Dockerfile's base image cannot be pulled, it builds a
# stand-in from the distribution's own packages and imports it under the base's name: debootstrap
# of Debian bookworm, slimmed as Debian's official images are; for the CPU image with its python3
# (3.11.2: the installer works without the tar filter 3.11.4 added), for the GPU image with CUDA
# 13.0's compiler and runtime from NVIDIA's PyPI wheels in /usr/local/cuda and the environment the
# nvidia/cuda images set. Where the host trusts a proxy's certificate authority (its CA bundle:
# HVD_APS_CA_BUNDLE, else pip's configured cert, else the system bundle), the image is built on a
# local layer over the base that trusts it too (pip, apt): in a temporary directory, never in the
# repository. Builds use the host's network (its resolver reaches the registries).
set -euo pipefail
cd "$(dirname "$0")/.."

KIND=cpu
TORCH_INDEX=""
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) KIND=gpu; shift ;;
    --torch-index) TORCH_INDEX=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    *) echo "docker_smoke.sh: unknown option $1 (known: --gpu, --torch-index URL, --wheels DIR)" >&2; exit 2 ;;
  esac
done
if [ "$KIND" = gpu ]; then DOCKERFILE=docker/Dockerfile; else DOCKERFILE=docker/Dockerfile.cpu; fi
BASE=$(sed -n 's/^ARG BASE=//p' "$DOCKERFILE")
IMAGE=hvd_aps:$KIND
# CUDA's compiler and runtime as NVIDIA publishes them on PyPI (the GPU stand-in's /usr/local/cuda)
CUDA_VERSION=13.0.1
CUDA_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-culibos==13.0.85"

say() { echo "[docker_smoke] $*"; }
fail() { echo "[docker_smoke] ERROR: $*" >&2; exit 1; }
command -v docker >/dev/null || fail "no docker client on PATH"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers (start dockerd)"
[ -n "$BASE" ] || fail "$DOCKERFILE names no ARG BASE"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# What Debian's official slim images do to a debootstrap tree (debuerreotype's slimify and its
# docker-clean apt setting), so that the stand-in weighs what the real base would: no apt lists or
# package caches (about 110 MB, which every later apt-get layer would otherwise write again), no
# docs, man pages or translations, now or from later installs.
slim() {
  local root=${1:?}
  [ "$root" != / ] && [ -d "$root/etc/apt" ] || fail "slim: $root is not a debootstrap tree"
  local clean='rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true'
  printf '%s\n' "DPkg::Post-Invoke { \"$clean\"; };" "APT::Update::Post-Invoke { \"$clean\"; };" \
    'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' >"$root/etc/apt/apt.conf.d/docker-clean"
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
    >"$root/etc/dpkg/dpkg.cfg.d/docker-slim"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
  find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
}

# CUDA's toolkit laid out as NVIDIA's installers do (/usr/local/cuda-X.Y, /usr/local/cuda linked to it)
add_cuda() {
  local root=${1:?} target="$WORK/cuda-wheels" home="/usr/local/cuda-${CUDA_VERSION%.*}"
  python3 -m pip install -q --no-deps --target "$target" $CUDA_WHEELS || fail "pip could not fetch CUDA's wheels"
  mv "$target/nvidia/cu13" "$root$home"
  rm -rf "$root$home/.metadata"
  (cd "$root$home/lib" && ln -s libcudart.so.13 libcudart.so && ln -s libnvvm.so.4 libnvvm.so)
  ln -s lib "$root$home/lib64"
  mkdir -p "$root$home/targets/x86_64-linux"
  ln -s ../../include "$root$home/targets/x86_64-linux/include"
  ln -s ../../lib "$root$home/targets/x86_64-linux/lib"
  ln -s "$home" "$root/usr/local/cuda"
}

standin() {
  local packages=ca-certificates
  [ "$KIND" = gpu ] || packages=python3,python3-venv,python3-dev,$packages
  command -v debootstrap >/dev/null || fail "debootstrap is needed for the stand-in base (apt-get install debootstrap)"
  debootstrap --variant=minbase --include="$packages" bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap failed"; }
  slim "$WORK/rootfs"
  local env=(--change 'ENV PATH=/usr/local/bin:/usr/bin:/bin')
  if [ "$KIND" = gpu ]; then
    add_cuda "$WORK/rootfs"
    env=(--change 'ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/bin:/usr/bin:/bin'
         --change 'ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64'
         --change "ENV CUDA_VERSION=$CUDA_VERSION NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility")
  fi
  tar -C "$WORK/rootfs" -c . | docker import "${env[@]}" - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
}

if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull "$BASE" >/dev/null 2>&1; then
  if [ "$KIND" = gpu ]; then
    say "$BASE cannot be pulled: building a stand-in (Debian bookworm, CUDA $CUDA_VERSION from NVIDIA's PyPI wheels)"
  else
    say "$BASE cannot be pulled: building a stand-in with debootstrap (Debian bookworm and its python3)"
  fi
  standin
fi

CA=${HVD_APS_CA_BUNDLE:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}
BUILD_BASE=$BASE
if [ -f "$CA" ]; then
  say "the image trusts the host's CA bundle ($CA), on a local layer over $BASE"
  mkdir -p "$WORK/ca"
  cp "$CA" "$WORK/ca/host-ca.pem"
  cat >"$WORK/ca/Dockerfile" <<EOF
FROM $BASE
COPY host-ca.pem /etc/ssl/certs/host-ca.pem
ENV PIP_CERT=/etc/ssl/certs/host-ca.pem REQUESTS_CA_BUNDLE=/etc/ssl/certs/host-ca.pem SSL_CERT_FILE=/etc/ssl/certs/host-ca.pem
EOF
  BUILD_BASE=hvd_aps-base:$KIND
  docker build --network host -q -t "$BUILD_BASE" "$WORK/ca" >/dev/null
fi

FIND_LINKS=""
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || fail "--wheels $WHEELS is not a directory"
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$PORT" >"$WORK/wheels.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
  FIND_LINKS=http://127.0.0.1:$PORT/
  say "offering the wheels of $WHEELS to pip at $FIND_LINKS"
fi

BUILD_S=5400  # the image's build, its bound (first build: 10 to 30 minutes)
DEMO_S=600    # a demo's run inside the image (under a minute), its bound
say "building $IMAGE from $DOCKERFILE (first build: 10 to 30 minutes, mostly Horovod)"
start=$(date +%s)
timeout "$BUILD_S" docker build --network host -f "$DOCKERFILE" --build-arg BASE="$BUILD_BASE" --build-arg PIP_FIND_LINKS="$FIND_LINKS" \
  ${TORCH_INDEX:+--build-arg TORCH_INDEX_URL="$TORCH_INDEX"} -t "$IMAGE" . || fail "docker build failed (or ran past $BUILD_S s)"
say "built in $(( $(date +%s) - start )) s; image size $(docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}')"

demo() {  # launcher name, then docker run's options and the command
  local name=$1 output accuracy
  shift
  output=$(docker run --rm "$@" 2>&1) || { echo "$output" | tail -30; fail "the demo under $name failed inside the image"; }
  accuracy=$(echo "$output" | grep -o "test accuracy [0-9.]*" | tail -1)
  [ -n "$accuracy" ] || { echo "$output" | tail -30; fail "the demo under $name printed no test accuracy"; }
  say "demo ($name): $accuracy"
}
say "running the 2-rank demo inside the image"
DEMO=(python examples/pytorch_digits.py --compression aps-e4m3)
demo "horovodrun, Gloo" "$IMAGE" timeout "$DEMO_S" horovodrun -np 2 -H localhost:2 --gloo "${DEMO[@]}"
demo "mpirun" --cap-add SYS_PTRACE "$IMAGE" timeout "$DEMO_S" mpirun -np 2 "${DEMO[@]}"
