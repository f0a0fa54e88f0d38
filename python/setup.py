"""Builds braid_torch, the torch.distributed backend over braid's C API.

    pip install --no-build-isolation ./python

--no-build-isolation builds against the torch already installed (the
extension must match its C++ and pybind11 ABI, which torch's
cpp_extension takes from torch itself). libbraid is built from this
checkout with CMake and linked in statically; where nvcc is found, the CUDA
kernel library (libbraid_cuda) is built too and installed inside the package,
where libbraid looks for it (CUDA tensors between the ranks of a host move
device to device with it).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "braid_torch builds against the installed torch: pip install torch first, "
        "then pip install --no-build-isolation ./python"
    )

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BRAID_BUILD = Path(os.environ.get("BRAID_TORCH_LIB_BUILD", ROOT / "build-python"))


CUDA_KERNELS = "libbraid_cuda.so.0"


def cuda_kernels_built():
    """Whether CMake found nvcc for BRAID_BUILD (its cache says so)."""
    cache = BRAID_BUILD / "CMakeCache.txt"
    return cache.exists() and "BRAID_HAVE_CUDA_BUILD:INTERNAL=ON" in cache.read_text()


class BuildWithLibbraid(BuildExtension):
    def run(self):
        jobs = str(max(1, min(os.cpu_count() or 1, 8)))
        subprocess.check_call(
            [
                "cmake", "-S", str(ROOT), "-B", str(BRAID_BUILD),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBRAID_BUILD_TESTS=OFF", "-DBRAID_BUILD_BENCH=OFF", "-DBRAID_BUILD_TOOLS=OFF",
                "-DBRAID_BUILD_EXAMPLES=OFF", "-DBRAID_WITH_TORCH=OFF", "-DBRAID_CUDA=AUTO",
            ]
        )
        targets = ["braid_static"] + (["braid_cuda"] if cuda_kernels_built() else [])
        subprocess.check_call(["cmake", "--build", str(BRAID_BUILD), "--target", *targets, "-j", jobs])
        super().run()
        if cuda_kernels_built():
            # Beside the extension, where libbraid (linked into it) looks.
            package_dir = Path(self.get_ext_fullpath("braid_torch._C")).parent
            shutil.copyfile(BRAID_BUILD / CUDA_KERNELS, package_dir / CUDA_KERNELS)


ext = CppExtension(
    name="braid_torch._C",
    sources=["braid_torch/csrc/backend.cc", "braid_torch/csrc/module.cc"],
    include_dirs=[str(ROOT / "include")],
    extra_objects=[str(BRAID_BUILD / "libbraid.a")],
    libraries=["rt", "hwloc"],  # libbraid.a discovers the topology through hwloc
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"],
)

setup(
    name="braid_torch",
    version="0.1.0",
    description="braid collectives as a torch.distributed backend",
    packages=["braid_torch"],
    # torch imports this at `import torch`, which registers "braid" (see the module).
    py_modules=["_braid_torch_autoload"],
    entry_points={"torch.backends": ["braid = _braid_torch_autoload:register"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildWithLibbraid},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
