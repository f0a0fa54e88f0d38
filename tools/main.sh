#!/usr/bin/env bash
# The main job: build if needed, then a 4-rank all_reduce benchmark with a
# correctness check on this host, printed as an nccl-tests table.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
exec mpirun --allow-run-as-root --oversubscribe -np "${NP:-4}" build/bench/all_reduce_perf -b 8 -e 64M -f 4 -c 1 "$@"
