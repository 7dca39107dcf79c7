#!/usr/bin/env bash
# Runs a Horovod rank's command, rank 0 under py-spy (raw stacks at 200 Hz into $SPY_OUT, default
# prof.txt; $SPY_OPTS, default "--idle --threads": every thread's samples, waiting included;
# "--gil --threads": only samples holding the interpreter), for examples/profile_split.py:
#
#   horovodrun -np 2 -H localhost:2 --gloo examples/py_spy_rank0.sh python examples/pytorch_synthetic_benchmark.py ...
set -euo pipefail
if [ "${HOROVOD_RANK:-${RANK:-0}}" = 0 ]; then
  # shellcheck disable=SC2086  # the options are words
  exec "$(dirname "$(command -v python)")/py-spy" record ${SPY_OPTS:---idle --threads} -r 200 -f raw \
    -o "${SPY_OUT:-prof.txt}" -- "$@"
fi
exec "$@"
