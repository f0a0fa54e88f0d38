#!/usr/bin/env bash
# The whole test suite: install dependencies, build, run every C++ test with
# ctest, then the PyTorch backend's tests with pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
(cd build && ctest --output-on-failure --timeout 900 "$@")
# The PyTorch backend: build braid_torch against torch, then its tests
# (exact results across processes, failures, DDP against gloo, torchrun,
# and a subset of torch's own distributed suite).
tools/install-torch.sh
${PYTHON:-python3} -m pytest -q python/tests
