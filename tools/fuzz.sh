#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang, ASan and UBSan, and
# runs each for BRAID_FUZZ_SECONDS seconds (30 by default), starting from a
# few well-formed seeds. Prints executions and crashes per target; a crash
# fails the script and leaves its input in build-fuzz/crashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
secs=${BRAID_FUZZ_SECONDS:-30}
dir=build-fuzz
[ -f "$dir/build.ninja" ] || CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DBRAID_FUZZ=ON -DBRAID_BUILD_TESTS=OFF -DBRAID_BUILD_BENCH=OFF -DBRAID_BUILD_TOOLS=OFF \
  -DBRAID_BUILD_EXAMPLES=OFF -DBRAID_WITH_TORCH=OFF -DBRAID_CUDA=OFF >/dev/null
cmake --build "$dir" -j "${BRAID_BUILD_JOBS:-$(nproc)}" --target fuzz_tcp_frames fuzz_handshake

# Seeds: a data frame, a zero-length frame, an abort frame; a root hello, a
# peer hello, a root answer and a root's refusal carrying the fuzz target's token.
seeds=$dir/seeds
mkdir -p "$seeds/tcp_frames" "$seeds/handshake" "$dir/crashes"
python3 - "$seeds" <<'PY'
import struct, sys
d = sys.argv[1]
tag = struct.pack("<QIiBBB5x", 8, 3, -1, 3, 0, 0)        # all_reduce #3, count 8, float32, sum
open(f"{d}/tcp_frames/data", "wb").write(struct.pack("<II", 0x46444242, 32) + tag + bytes(range(32)))
open(f"{d}/tcp_frames/empty_then_data", "wb").write(
    struct.pack("<II", 0x46444242, 0) + tag + struct.pack("<II", 0x46444242, 4) + tag + b"abcd")
# A length far past the slot, and more bytes behind it than all slots hold
# (also lifts libFuzzer's input size, 4 KiB by default, to the seed's).
open(f"{d}/tcp_frames/oversized", "wb").write(struct.pack("<II", 0x46444242, 0x7fffffff) + tag + bytes(20000))
msg = b"rank 3 failed: out of memory"
open(f"{d}/tcp_frames/abort", "wb").write(
    struct.pack("<II", 0x41444242, 4 + len(msg)) + bytes(24) + struct.pack("<I", 6) + msg)
token = b"braid-fuzz-token"
addr = struct.pack("<H", 2) + struct.pack(">H", 4000) + bytes([127, 0, 0, 1]) + bytes(12)
open(f"{d}/handshake/root_hello", "wb").write(b"\0" + struct.pack("<II", 0x31445242, 1) + token + struct.pack("<II", 1, 4) + addr)
open(f"{d}/handshake/peer_hello", "wb").write(b"\1\4" + struct.pack("<II", 0x31445242, 2) + token + struct.pack("<II", 2, 100))
open(f"{d}/handshake/root_reply", "wb").write(b"\2\1" + struct.pack("<II", 0x31445242, 2) + addr + addr)
open(f"{d}/handshake/refusal", "wb").write(b"\4" + struct.pack("<II", 0x31465242, 20) + b"rank 1 joined twice\x01")
open(f"{d}/handshake/unique_id", "wb").write(b"\3" + struct.pack("<IH2x", 0x31445242, 1) + addr + token)
PY

status=0
for t in tcp_frames handshake; do
  corpus=$dir/corpus/$t
  mkdir -p "$corpus"
  log=$dir/fuzz_$t.log
  if "$dir/tests/fuzz/fuzz_$t" -max_total_time="$secs" -print_final_stats=1 -timeout=10 \
       -artifact_prefix="$dir/crashes/$t-" "$corpus" "$seeds/$t" >"$log" 2>&1; then
    result=ok
  else
    result=CRASH
    status=1
    tail -40 "$log"
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  echo "fuzz_$t: ${secs}s, $execs executions, coverage $cov edges, corpus $(ls "$corpus" | wc -l) inputs: $result"
done
exit $status
