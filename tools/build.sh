#!/usr/bin/env bash
# Configures and builds braid into ${BUILD_DIR:-build} (Release with debug info).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# Configures on the first build, and again whenever options are given (a
# build made before torch was installed then finds it: -DBRAID_WITH_TORCH=ON).
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
fi
cmake --build "$BUILD_DIR" -j "${BRAID_BUILD_JOBS:-$(nproc)}"
