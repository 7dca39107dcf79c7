#!/usr/bin/env bash
# Build the CPU image and run the 2-rank demo inside it; print the image size and the demo's
# accuracy; exit non-zero on any failure. Not part of CI (it takes minutes).
#
#   bash scripts/docker_smoke.sh [--torch-index URL] [--wheels DIR]
#
# --torch-index: an index of CPU-only torch wheels (https://download.pytorch.org/whl/cpu). --wheels:
# a directory of wheels pip may take first (torch's CPU wheel where that index is out of reach),
# served from this host on loopback for the build only (PIP_FIND_LINKS; nothing of it stays in the
# image but what pip installs). After the build it runs the 2-rank demo with Gloo and with MPI
# (the container given SYS_PTRACE: MPICH copies between a host's ranks with process_vm_readv,
# which Docker's default profile refuses).
#
# Needs a running Docker daemon. Where the base image (python:3.11-slim-bookworm) cannot be
# pulled, it builds a stand-in from the distribution's own packages: debootstrap of Debian bookworm
# with its python3 (3.11.2: the installer works without the tar filter 3.11.4 added), imported
# under the Dockerfile's base name. Where the host trusts a proxy's certificate authority (its CA
# bundle: HVD_APS_CA_BUNDLE, else pip's configured cert, else the system bundle), the image is built
# on a local layer over the base that trusts it too (pip, apt): in a temporary directory, never in
# the repository. Builds use the host's network (its resolver reaches the registries).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=python:3.11-slim-bookworm
IMAGE=hvd_aps:cpu
TORCH_INDEX=""
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --torch-index) TORCH_INDEX=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    *) echo "docker_smoke.sh: unknown option $1 (known: --torch-index URL, --wheels DIR)" >&2; exit 2 ;;
  esac
done

say() { echo "[docker_smoke] $*"; }
fail() { echo "[docker_smoke] ERROR: $*" >&2; exit 1; }
command -v docker >/dev/null || fail "no docker client on PATH"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers (start dockerd)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull "$BASE" >/dev/null 2>&1; then
  say "$BASE cannot be pulled: building a stand-in with debootstrap (Debian bookworm and its python3)"
  command -v debootstrap >/dev/null || fail "debootstrap is needed for the stand-in base (apt-get install debootstrap)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm \
    "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap failed"; }
  tar -C "$WORK/rootfs" -c . | docker import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
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
  docker build --network host -q -t hvd_aps-base:local "$WORK/ca" >/dev/null
  BUILD_BASE=hvd_aps-base:local
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

say "building $IMAGE (first build: about 15 minutes, mostly Horovod)"
start=$(date +%s)
docker build --network host -f docker/Dockerfile.cpu --build-arg BASE="$BUILD_BASE" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX" --build-arg PIP_FIND_LINKS="$FIND_LINKS" -t "$IMAGE" . \
  || fail "docker build failed"
say "built in $(( $(date +%s) - start )) s; image size $(docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}')"

say "running the 2-rank demo inside the image"
OUTPUT=$(docker run --rm "$IMAGE" horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py \
  --compression aps-e4m3 2>&1) || { echo "$OUTPUT" | tail -30; fail "the demo failed inside the image"; }
ACCURACY=$(echo "$OUTPUT" | grep -o "test accuracy [0-9.]*" | tail -1)
[ -n "$ACCURACY" ] || { echo "$OUTPUT" | tail -30; fail "the demo printed no test accuracy"; }
say "demo (Gloo): $ACCURACY"

OUTPUT=$(docker run --rm --cap-add SYS_PTRACE "$IMAGE" mpirun -np 2 python examples/pytorch_digits.py --compression aps-e4m3 2>&1) \
  || { echo "$OUTPUT" | tail -30; fail "the demo under mpirun failed inside the image"; }
ACCURACY=$(echo "$OUTPUT" | grep -o "test accuracy [0-9.]*" | tail -1)
[ -n "$ACCURACY" ] || { echo "$OUTPUT" | tail -30; fail "the demo under mpirun printed no test accuracy"; }
say "demo (MPI): $ACCURACY"
