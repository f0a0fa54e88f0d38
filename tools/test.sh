#!/usr/bin/env bash
# The whole test suite: install dependencies, build, run every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
cd build
ctest --output-on-failure --timeout 900 "$@"
