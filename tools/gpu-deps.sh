#!/usr/bin/env bash
# Run here, where apt works, before a GPU run: saves the Debian packages
# that tools/gpu-check.sh needs and the GPU machine's image may lack (hwloc,
# GoogleTest, pkg-config) under .gpu-deps/ (git-ignored, under 1 MiB).
# Carry .gpu-deps with the run; gpu-check.sh unpacks them there under
# .gpu-deps/root (never into /) and builds against them. Open MPI is not
# carried: without it gpu-check.sh leaves the MPI-launched benchmarks out.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
rm -f ./*.deb
# Downloaded as root, apt's sandbox user cannot write here: harmless.
apt-get download libhwloc15 libhwloc-dev libgtest-dev pkgconf pkgconf-bin libpkgconf3 2>&1 |
  grep -v "Download is performed unsandboxed" || true
ls -la ./*.deb
