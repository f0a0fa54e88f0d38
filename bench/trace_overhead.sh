#!/usr/bin/env bash
# What BRAID_TRACE_FILE costs: all_reduce_perf with and without tracing,
# alternated ROUNDS times (default 5) so both see the same machine; prints,
# per size, the median out-of-place time of each and traced/untraced.
# usage: bench/trace_overhead.sh [NP] [extra all_reduce_perf flags]
set -euo pipefail
cd "$(dirname "$0")/.."
np=${1:-2}
shift || true
rounds=${ROUNDS:-5}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
EXTRA=("$@")
run() {  # $1: output file; $2: trace path pattern, or empty for no trace
  local xtrace=()
  [ -n "$2" ] && xtrace=(-x "BRAID_TRACE_FILE=$2")
  mpirun --allow-run-as-root --oversubscribe -np "$np" -x BRAID_SOCKET_IFNAME "${xtrace[@]}" \
    build/bench/all_reduce_perf -b 8 -e 4M -f 8 -n 200 -w 20 -c 0 "${EXTRA[@]}" >>"$1"
}
for ((i = 0; i < rounds; i++)); do
  run "$dir/off.txt" ""
  run "$dir/on.txt" "$dir/trace-%r.json"
done
python3 - "$dir/off.txt" "$dir/on.txt" <<'PY'
import statistics, sys
def times(path):
    t = {}
    for line in open(path):
        c = line.split()
        if c and c[0].isdigit():
            t.setdefault(int(c[0]), []).append(float(c[5]))
    return {k: statistics.median(v) for k, v in t.items()}
off, on = times(sys.argv[1]), times(sys.argv[2])
print(f"{'size':>10} {'untraced us':>12} {'traced us':>10} {'traced/untraced':>16}")
for size in sorted(off):
    print(f"{size:>10} {off[size]:>12.2f} {on[size]:>10.2f} {on[size] / off[size]:>16.3f}")
PY
