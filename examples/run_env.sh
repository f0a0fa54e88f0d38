#!/usr/bin/env bash
# Runs a program as N ranks (default 2) under the torchrun environment
# (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) on this host; fails if any rank fails.
# usage: run_env.sh PROGRAM [ARGS...]
set -uo pipefail
n=${NRANKS:-2}
port=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((r = 0; r < n; r++)); do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$n RANK=$r "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
