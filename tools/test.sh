#!/usr/bin/env bash
# The whole test suite: install dependencies (torch included, so that the
# libtorch DDP adapter is built and tested too), build, run every C++ test
# with ctest, then the PyTorch backend's tests with pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
# The project's own C++ and CUDA sources follow .clang-format.
git ls-files -z '*.c' '*.cc' '*.h' '*.hpp' '*.cu' '*.cuh' | xargs -0 clang-format --dry-run --Werror
# torch, and braid_torch built against it from ./python.
tools/install-torch.sh
# ON, not AUTO: a build configured before torch was installed (tools/main.sh
# first) must not skip the libtorch tests without a word.
BUILD_DIR=build tools/build.sh -DBRAID_WITH_TORCH=ON
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
(cd build && ctest --output-on-failure --timeout 900 "$@")
# The PyTorch backend's tests (exact results across processes, failures,
# DDP against gloo, torchrun, and a subset of torch's own distributed suite).
${PYTHON:-python3} -m pytest -q python/tests
