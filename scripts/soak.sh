#!/usr/bin/env bash
# The multi-process tests in a loop, to catch a hang or a failure that shows once in many runs.
#
#   scripts/soak.sh [ROUNDS] [TEST FILE ... [-k EXPRESSION]]   (default: 20 rounds of every multi-process test file)
#
# SOAK_LOAD=N keeps N busy loops running, each pinned to one of the last N cores, for the whole soak
# (a machine whose cores the tests share with other work: "a loaded second core" is SOAK_LOAD=1).
#
# Each round runs pytest (the slow tests too, pytest.ini) under a time limit (SOAK_ROUND_S, default 1800 s); a round past it is
# interrupted (SIGINT: pytest prints where it waited) and counted as a hang. Every round's output
# goes to SOAK_OUT (default results/soak/round<N>.txt); the summary line counts passes, failures
# and hangs, and the exit status is non-zero if any round failed or hung. The tests' own launchers
# time out stalled ranks and put their stacks in the failure (tests/hosts_run.py).
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${1:-20}
shift $(( $# > 0 ? 1 : 0 ))
# the files whose tests start real ranks: horovodrun, torchrun (tests/support's launch_ddp_checks,
# test_fsdp's torchrun), the hosts' launcher, or processes of their own (multiprocessing)
FILES=("$@")
LAUNCHERS="horovodrun|torch\.distributed\.run|torchrun\(|launch_ddp_checks|hosts_run|multiprocessing"
[ ${#FILES[@]} -gt 0 ] || mapfile -t FILES < <(grep -l -E "$LAUNCHERS" tests/test_*.py)
LIMIT=${SOAK_ROUND_S:-1800}
OUT=${SOAK_OUT:-results/soak}
mkdir -p "$OUT"

LOAD=${SOAK_LOAD:-0}
hogs=()
for i in $(seq 1 "$LOAD"); do
  taskset -c $(( $(nproc) - i )) sh -c 'while :; do :; done' &
  hogs+=($!)
done
trap '[ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null' EXIT

passed=0 failed=0 hung=0
for round in $(seq 1 "$ROUNDS"); do
  started=$(date +%s)
  timeout --signal=INT --kill-after=60 "$LIMIT" .venv/bin/python -m pytest -q -x -m "slow or not slow" "${FILES[@]}" \
    > "$OUT/round$round.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - started ))
  case $rc in
    0) passed=$((passed + 1)); verdict=passed ;;
    124|137) hung=$((hung + 1)); verdict="HUNG (past ${LIMIT} s)" ;;
    *) failed=$((failed + 1)); verdict="FAILED (rc $rc)" ;;
  esac
  echo "[soak] round $round/$ROUNDS: $verdict in ${took} s: $(tail -n 1 "$OUT/round$round.txt")"
done
echo "[soak] $ROUNDS rounds of ${FILES[*]} (busy loops: $LOAD): $passed passed, $failed failed, $hung hung (output: $OUT)"
[ $((failed + hung)) -eq 0 ]
