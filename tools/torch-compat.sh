#!/usr/bin/env bash
# braid_torch with other torch releases than the one tools/test.sh installs:
# for each release named (default: 2.5.1, the oldest CI runs), a venv under
# .torch-compat/<release> with that torch from PyPI, braid_torch built
# against it from a copy of this tree (python/build keeps objects compiled
# for one torch), and the backend's tests (python/tests/test_backend.py;
# what a release lacks is skipped, saying so). braid_torch compiles against
# torch 2.4 and later (python/braid_torch/csrc/torch_compat.h).
#   tools/torch-compat.sh [RELEASE ...]      e.g. tools/torch-compat.sh 2.5.1 2.8.0
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
[ $# -eq 0 ] && set -- 2.5.1
tools/install-deps.sh  # what libbraid builds with (quick when it is there)
# venv and the headers an extension compiles against, where Debian's own
# python lacks them (pyenv's and venv's pythons have both).
if ! "$PY" -c 'import ensurepip, venv, sysconfig, os, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv python3-dev >/dev/null
fi
for release in "$@"; do
  dir=$ROOT/.torch-compat/$release
  venv_py=$dir/venv/bin/python
  if ! "$venv_py" - "$release" >/dev/null 2>&1 <<'PYEOF'; then
import sys
import torch, pytest, expecttest, numpy
assert torch.__version__.split("+")[0] == sys.argv[1]
PYEOF
    echo "torch-compat: installing torch==$release into $dir/venv"
    rm -rf "$dir/venv"
    "$PY" -m venv "$dir/venv"
    "$venv_py" -m pip install -q "torch==$release" numpy pytest expecttest setuptools wheel
  fi
  echo "torch-compat: building braid_torch against torch $release"
  rm -rf "$dir/src"
  mkdir -p "$dir/src"
  tar -C "$ROOT" --exclude=./.git --exclude=./.torch-compat --exclude='./build*' --exclude=./python/build \
    --exclude='./python/braid_torch/*.so' -cf - . | tar -C "$dir/src" -xf -
  (cd "$dir/src" && "$venv_py" -m pip install -q --no-build-isolation ./python)
  echo "torch-compat: the backend's tests with torch $release"
  (cd "$dir/src/python/tests" && PATH="$dir/venv/bin:$PATH" "$venv_py" -m pytest -q -rs test_backend.py)
done
