#!/usr/bin/env bash
# Runs a program as N ranks (default 2) under the torchrun environment
# (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) on this host; fails if any rank fails.
# usage: run_env.sh PROGRAM [ARGS...]
set -uo pipefail
n=${NRANKS:-2}
# A free port below the kernel's ephemeral range (32768 and up here): a
# port from that range may be taken meanwhile by another test's outgoing
# connection, and rank 0 then cannot listen while the others wait for it
# until the init timeout.
free_port() {
  for _ in $(seq 50); do
    local p=$((20000 + RANDOM % 12000))
    if python3 -c 'import socket, sys; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$p" \
      2>/dev/null; then
      echo "$p"
      return
    fi
  done
  echo "run_env.sh: no free port found in 20000-31999" >&2
  exit 1
}
port=${MASTER_PORT:-$(free_port)}
pids=()
for ((r = 0; r < n; r++)); do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$n RANK=$r "$@" &
  pids+=($!)
done
# A rank that fails (rank 0 unable to listen, say) ends the others at once
# instead of leaving them to wait out their init timeout.
rc=0
for ((left = n; left > 0; left--)); do
  if ! wait -n "${pids[@]}" 2>/dev/null; then
    rc=1
    kill "${pids[@]}" 2>/dev/null
  fi
done
exit $rc
