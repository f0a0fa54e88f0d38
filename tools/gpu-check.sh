#!/usr/bin/env bash
# On a machine with a GPU: builds the CUDA parts for that GPU, runs the GPU
# tests and the kernel benchmark, and prints a short table. Under 8 minutes
# on the H200 machine's 16 cores (most of it the build).
#
#   tools/gpu-check.sh            # BUILD_DIR=build-gpu by default
#
# The GPU machine's image has nvcc, CMake, ninja and torch but perhaps not
# hwloc, GoogleTest or pkg-config, and cannot fetch them: run
# tools/gpu-deps.sh here first and carry .gpu-deps with the run (the device
# tool's `carry: [".gpu-deps"]`); this script then unpacks them under
# .gpu-deps/root and builds against them. Without Open MPI (mpicc) the
# MPI-launched benchmarks are left out; none of this script's needs them.
#
# What it covers today: the reduction kernels of kernels/cuda against
# kernels/cpu (every dtype x op, any alignment) and against the device's copy
# bandwidth; stream-ordered collectives on device memory with several ranks
# on the one GPU, through CUDA IPC (device to device, reductions on the GPU)
# and through host staging (tests/cuda_stream_test); the C API refusing
# device buffers in host-ordered calls; and the all_reduce of 4 ranks on the
# GPU on both paths beside the copy bandwidth (cuda_stream_bench); and, where
# a CUDA build of torch is installed, braid_torch on CUDA tensors
# (python/tests/test_cuda.py).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
OUT=${OUT:-$BUILD_DIR/gpu-check}
mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU here (nvidia-smi -L failed)" >&2
  exit 1
fi
nvidia-smi -L
start=$(date +%s)
if ls .gpu-deps/*.deb >/dev/null 2>&1; then
  # Carried packages (tools/gpu-deps.sh), unpacked beside the tree, not into /.
  root=$PWD/.gpu-deps/root
  rm -rf "$root" && mkdir -p "$root"
  for f in .gpu-deps/*.deb; do dpkg -x "$f" "$root"; done
  lib=$root/usr/lib/x86_64-linux-gnu
  export PATH=$root/usr/bin:$PATH
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}  # braid_torch's link of -lhwloc
  export PKG_CONFIG_LIBDIR=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root
  export CMAKE_PREFIX_PATH=$root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  echo "gpu-check: using the carried packages in $root"
fi
mpi=ON
command -v mpicc >/dev/null || { mpi=OFF; echo "gpu-check: no Open MPI here: the MPI-launched benchmarks are left out"; }
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # "native": compile for the GPUs of this machine only (quickest build).
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRAID_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=native -DBRAID_BUILD_EXAMPLES=OFF -DBRAID_BENCH_MPI=$mpi >"$OUT/configure.log" 2>&1 ||
    { tail -40 "$OUT/configure.log"; echo "gpu-check: configure failed" >&2; exit 1; }
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" --target cuda_kernels_test cuda_stream_test cuda_kernel_bench cuda_stream_bench >"$OUT/build.log" 2>&1 ||
  { tail -60 "$OUT/build.log"; echo "gpu-check: build failed" >&2; exit 1; }
echo "gpu-check: built in $(($(date +%s) - start)) s"
test_status=0
"$BUILD_DIR/tests/cuda_kernels_test" --gtest_brief=1 >"$OUT/tests.log" 2>&1 || test_status=$?
BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo} "$BUILD_DIR/tests/cuda_stream_test" --gtest_brief=1 \
  >>"$OUT/tests.log" 2>&1 || test_status=$?
# Streams sharing one hardware queue (Megatron-style jobs set this): a user
# stream parked in cuStreamWaitValue32 may then hold back the work braid
# enqueues behind it on its own stream. Bounded, so a deadlock shows as a
# failure here instead of eating the session.
if ! CUDA_DEVICE_MAX_CONNECTIONS=1 BRAID_TIMEOUT=30 BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo} \
  timeout 120 "$BUILD_DIR/tests/cuda_stream_test" --gtest_brief=1 \
  --gtest_filter='*AllReduceOnDeviceMemoryWithFourRanksOnOneGpu*' >"$OUT/max_connections_1.log" 2>&1; then
  echo "gpu-check: with CUDA_DEVICE_MAX_CONNECTIONS=1 the stream tests failed or hung (see $OUT/max_connections_1.log)" >&2
  tail -20 "$OUT/max_connections_1.log" >&2
  test_status=1
else
  echo "gpu-check: CUDA_DEVICE_MAX_CONNECTIONS=1: ok"
fi
skipped=$(grep -c '^\[  SKIPPED \]' "$OUT/tests.log" || true)
tail -3 "$OUT/tests.log"
if [ "$test_status" -ne 0 ] || [ "$skipped" -ne 0 ]; then
  # Go on to the benchmarks: a GPU session is short, every figure counts.
  echo "gpu-check: GPU tests failed or skipped (see $OUT/tests.log)" >&2
  grep -E -B2 -A12 'Failure|FAILED|SKIPPED' "$OUT/tests.log" | head -150 >&2
  test_status=1
fi
bench_status=0
"$BUILD_DIR/bench/cuda_kernel_bench" --bytes 1G --iters 20 | tee "$OUT/kernel_bench.txt" || bench_status=$?
# Stream-ordered all_reduce, 4 ranks on the one GPU: CUDA IPC, then host staging.
BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo} "$BUILD_DIR/bench/cuda_stream_bench" --ranks 4 -b 1M -e 256M -f 4 -n 5 |
  tee "$OUT/stream_bench.txt" || bench_status=$?
# The torch backend on CUDA tensors, where a CUDA torch is installed (no
# network is needed: braid_torch builds against it in place).
torch_status=0
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  BRAID_TORCH_LIB_BUILD="$BUILD_DIR/python" python3 -m pip install -q --no-deps --no-build-isolation ./python \
    >"$OUT/torch_build.log" 2>&1 || { tail -40 "$OUT/torch_build.log"; torch_status=1; }
  if [ "$torch_status" -eq 0 ]; then
    (cd python/tests && BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo} python3 -m pytest -q test_cuda.py) 2>&1 |
      tee "$OUT/torch_tests.txt" | tail -40
    torch_status=${PIPESTATUS[0]}
  fi
else
  echo "gpu-check: no torch with CUDA here; the braid_torch CUDA tests did not run"
fi
echo "gpu-check: done in $(($(date +%s) - start)) s (tests $test_status, benchmarks $bench_status, torch $torch_status)"
[ "$test_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$torch_status" -eq 0 ]
