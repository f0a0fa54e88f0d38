#!/usr/bin/env bash
# Sanitizer builds: ASan+UBSan and TSan, each running the unit and
# multi-process suites (the long correctness matrix stays in the plain build).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
# Init's timing of peer reads (1-4 MiB collectives, 32 calls each, per
# communicator) took most of the ThreadSanitizer run: 14 s of a 14.2 s test
# that makes a few communicators. Off here; the tests of the probe turn it on.
export BRAID_TUNE_PROBE=${BRAID_TUNE_PROBE:-0}
for san in ${BRAID_SANITIZERS:-address thread}; do
  dir=build-$san
  [ -f "$dir/build.ninja" ] || cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DBRAID_SANITIZE="$san" -DBRAID_BUILD_BENCH=OFF -DBRAID_BUILD_TOOLS=ON \
    -DBRAID_BUILD_EXAMPLES=OFF -DBRAID_WITH_TORCH=OFF -DBRAID_CUDA=OFF
  cmake --build "$dir" -j "${BRAID_BUILD_JOBS:-$(nproc)}" --target kernels_test api_test collectives_test failure_test ddp_test observability_test \
    tuner_test multihost_test tcp_connection_test stream_test cuda_ipc_test window_test
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
     ctest --output-on-failure --timeout 900 -R '^(kernels|api|collectives|failure|ddp|observability|tuner|multihost|tcp_connection|stream|cuda_ipc|window)_test$')
done
