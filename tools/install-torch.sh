#!/usr/bin/env bash
# Installs what the PyTorch backend builds and tests with (torch, pytest,
# expecttest; pyspark, pandas and pyarrow for the TorchDistributor test) and
# then braid_torch itself from ./python. Quick when torch is already there;
# the braid_torch build is incremental (build-python/).
# TORCH_VERSION picks the torch release (default: the one CI tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
# Spark 3.5 runs on the Java 17 that install-deps.sh installs.
PYSPARK_VERSION=${PYSPARK_VERSION:-3.5.3}
# Debian's own python refuses pip without this; pyenv and venv pythons ignore it.
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-pip python3-dev >/dev/null
fi
have() { "$PY" - "$@" <<'PYEOF' 2>/dev/null
import importlib, sys
import torch
assert torch.__version__.split("+")[0] == sys.argv[1]
for m in ("pytest", "expecttest", "wheel", "setuptools", "pyspark", "pandas", "pyarrow"):
    importlib.import_module(m)
PYEOF
}
if ! have "$TORCH_VERSION"; then
  echo "install-torch: installing torch==$TORCH_VERSION, pytest, expecttest, pyspark"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" pytest expecttest wheel "setuptools>=64" numpy \
    "pyspark==$PYSPARK_VERSION" pandas pyarrow
fi
# --no-build-isolation: build against the torch installed above.
"$PY" -m pip install -q --no-build-isolation ./python
