#!/usr/bin/env bash
# What BRAID_TRACE_FILE costs: all_reduce_perf --trace-compare, which times
# an untraced and a traced communicator in one run, taking turns at every
# size (ROUNDS turns each, default 9, best kept), and prints traced/untraced.
# Separate runs of the two differ by more than the effect (the machine's
# speed drifts between runs); turns inside one run see the same machine.
# usage: bench/trace_overhead.sh [NP] [extra all_reduce_perf flags]
set -euo pipefail
cd "$(dirname "$0")/.."
np=${1:-2}
shift || true
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
mpirun --allow-run-as-root --oversubscribe -np "$np" -x BRAID_SOCKET_IFNAME \
  build/bench/all_reduce_perf -b 8 -e 4M -f 8 -n 1000 -w 50 -c 1 --rounds "${ROUNDS:-9}" \
  --trace-compare "$dir/trace-%r.json" "$@"
