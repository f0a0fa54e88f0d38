#!/usr/bin/env bash
# Installs what braid builds and tests with, on Debian 12 as root (or with sudo).
# Quick when everything is already there.
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config git
          libhwloc-dev hwloc
          libopenmpi-dev openmpi-bin
          libibverbs-dev rdma-core
          googletest libgtest-dev libbenchmark-dev
          clang-format python3
          clang libclang-rt-14-dev
          openjdk-17-jre-headless)  # Spark, for the TorchDistributor test
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
