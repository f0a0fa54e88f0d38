#!/usr/bin/env bash
# The *_perf binaries under mpirun, briefly: every collective checks its
# results at a few sizes on 2 ranks (3 for the rooted and per-rank ones), and
# the side-by-side modes (--compare mpi, --algos, --trace-compare) and flag
# errors behave. Times are never asserted. usage: perf_binaries_test.sh BINDIR
set -uo pipefail
bin=$1
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
mpirun=("${MPIRUN:-mpirun}" --allow-run-as-root --oversubscribe -x BRAID_SOCKET_IFNAME)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
# run NAME NP BINARY ARGS...: runs it, keeps its output in $dir/NAME
run() {
  local name=$1 np=$2
  shift 2
  "${mpirun[@]}" -np "$np" "$@" >"$dir/$name" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || fail "$name exited with $rc: $(tail -5 "$dir/$name")"
  grep -q "^# Out of bounds values : 0 OK" "$dir/$name" || fail "$name: no clean check line"
}
rows() { grep -cE '^ +[0-9]+ ' "$dir/$1"; }

for coll in all_reduce broadcast reduce all_gather reduce_scatter gather scatter alltoall sendrecv; do
  np=2
  case $coll in reduce | gather | scatter | alltoall) np=3 ;; esac
  run "$coll" "$np" "$bin/${coll}_perf" -b 8 -e 8K -f 32 -n 3 -w 1 -c 1
  [ "$(rows "$coll")" -eq 3 ] || fail "$coll: expected 3 size rows (8 B, 256 B, 8 KiB)"
done

run all_types 2 "$bin/all_reduce_perf" -b 64 -e 64 -n 2 -w 1 -c 1 -d all -o all
# 10 dtypes: 6 integer types x 7 ops (no avg) + 4 floating types x 5 ops.
[ "$(rows all_types)" -eq 62 ] || fail "all_types: expected 62 rows, got $(rows all_types)"

run compare_mpi 2 "$bin/all_reduce_perf" -b 8 -e 4K -f 8 -n 3 -w 1 -c 1 --compare mpi
grep -q "^# Avg bus bandwidth ratio braid/mpi : [0-9]" "$dir/compare_mpi" || fail "compare_mpi: no ratio line"

# MPI_Bcast has one buffer: its ratio is against braid in place, not out of
# place. Same size, same busbw factor: the ratio is MPI's time (column 10)
# over braid's in-place time (13), printed with more digits than the busbw
# columns (a loaded machine's 0.01 GB/s would round the check away).
run compare_bcast 2 "$bin/broadcast_perf" -b 64K -e 64K -n 3 -w 1 -c 1 --compare mpi
grep -q "^#.*mpi in-place" "$dir/compare_bcast" || fail "compare_bcast: no 'mpi in-place' title"
awk '/^ +[0-9]/ { r = $10 / $13; x = $12; sub("x", "", x); exit !(x > 0 && (x - r) ^ 2 < (0.02 * r + 0.01) ^ 2) }' \
  "$dir/compare_bcast" || fail "compare_bcast: the ratio is not braid in-place busbw / MPI busbw"

run algos 2 "$bin/all_reduce_perf" -b 8 -e 4K -f 8 -n 3 -w 1 -c 1 --algos ring,direct,auto --rounds 2
grep -qE "^#.* ring +direct +auto$" "$dir/algos" || fail "algos: no column per algorithm"
grep -qE "^# Avg bus bandwidth    : ring [0-9.]+, direct [0-9.]+, auto [0-9.]+$" "$dir/algos" ||
  fail "algos: no bandwidth per algorithm"

run trace 2 "$bin/all_reduce_perf" -b 8 -e 4K -f 8 -n 3 -w 1 -c 1 --trace-compare "$dir/t-%r.json"
grep -qE "traced/untraced$" "$dir/trace" || fail "trace: no ratio column"
[ -s "$dir/t-0.json" ] && [ -s "$dir/t-1.json" ] || fail "trace: the traced communicator wrote no trace"
# untraced (the default communicator and its column) writes none
[ "$(ls "$dir" | grep -c '^t-')" -eq 2 ] || fail "trace: expected exactly two trace files: $(ls "$dir")"

# --env-compare: the variant's communicator is made with the setting, the
# launched one without (only the variant writes a trace).
run env 2 "$bin/broadcast_perf" -b 8 -e 4K -f 8 -n 3 -w 1 -c 1 --env-compare "BRAID_TRACE_FILE=$dir/e-%r.json"
grep -qE "^#.* launched +variant +variant/launched$" "$dir/env" || fail "env: no launched, variant and ratio columns"
grep -qF "# variant: BRAID_TRACE_FILE=$dir/e-%r.json" "$dir/env" || fail "env: the variant's setting is not printed"
[ "$(ls "$dir" | grep -c '^e-')" -eq 2 ] || fail "env: expected exactly the variant's two trace files: $(ls "$dir")"

# -R 1: registered buffers, checked, in and out of place, above and below
# the window threshold (16 KiB), and MPI on the same buffers.
for coll in all_reduce broadcast all_gather reduce_scatter; do
  run "registered_$coll" 2 "$bin/${coll}_perf" -b 4K -e 256K -f 8 -n 3 -w 1 -c 1 -R 1 --compare mpi
  grep -q "^# braid version .*registered host memory" "$dir/registered_$coll" ||
    fail "registered_$coll: the header does not say the buffers are registered"
done

# ceiling (threads of one process, no MPI): every collective's result is
# checked, 3 threads, both types, sizes that do not split evenly into lines.
for coll in all_reduce broadcast all_gather reduce_scatter; do
  "$bin/ceiling" -C "$coll" -t 3 -b 96 -e 96K -f 32 -n 3 -w 1 -c 1 -d all >"$dir/ceiling_$coll" 2>&1 ||
    fail "ceiling -C $coll exited with $?: $(tail -3 "$dir/ceiling_$coll")"
  grep -q "^# ceiling: $coll.* between 3 threads" "$dir/ceiling_$coll" || fail "ceiling -C $coll: no title"
  grep -q "^# Wrong values         : 0 OK" "$dir/ceiling_$coll" || fail "ceiling -C $coll: results not checked OK"
  [ "$(rows "ceiling_$coll")" -eq 6 ] || fail "ceiling -C $coll: expected 6 rows (3 sizes x 2 types)"
done
"$bin/ceiling" -C all_to_all >"$dir/bad" 2>&1 && fail "ceiling -C all_to_all was accepted"
grep -qF "ceiling: error: -C: unknown collective 'all_to_all'" "$dir/bad" || fail "ceiling -C all_to_all: $(tail -1 "$dir/bad")"

# Bad input: exit status 2 and the flag named.
bad() {  # bad COLLECTIVE MESSAGE ARGS...
  local coll=$1 want=$2
  shift 2
  "${mpirun[@]}" -np 1 "$bin/${coll}_perf" "$@" >"$dir/bad" 2>&1
  local rc=$?
  [ $rc -ne 0 ] || fail "'$*' was accepted"
  grep -qF -- "$want" "$dir/bad" || fail "'$*' did not say '$want': $(head -3 "$dir/bad")"
}
bad all_reduce "-R: expected 0 or 1" -R 2
bad all_reduce "--trace-compare: cannot be combined with --compare" --trace-compare x.json --compare mpi
bad all_reduce "--trace-compare: cannot be combined with --algos" --trace-compare x.json --algos ring
bad all_reduce "--rounds: expected 1 to 1000 rounds" --algos ring --rounds 0
bad all_reduce "--env-compare: expected BRAID_NAME=VALUE, got 'BRAID_SPIN_US'" --env-compare BRAID_SPIN_US
bad all_reduce "--env-compare: expected BRAID_NAME=VALUE, got 'PATH=/'" --env-compare PATH=/
bad all_reduce "--env-compare: cannot be combined with --compare" --env-compare BRAID_SPIN_US=0 --compare mpi
bad all_reduce "-o: avg is not defined for int32" -d int32 -o avg
bad gather "--algos: gather has no algorithms to choose" --algos ring
if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "perf binaries: all checks passed"
