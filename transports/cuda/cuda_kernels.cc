#include "transports/cuda/cuda_kernels.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace braid {
namespace {

constexpr const char* kLibraryName = "libbraid_cuda.so.0";

// The directory libbraid (or the program or extension it is linked into)
// was loaded from.
std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cuda_kernels), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

Status load(CudaKernels* k) {
  std::string tried;
  void* lib = nullptr;
  if (const char* forced = std::getenv("BRAID_CUDA_KERNELS"); forced != nullptr && *forced != '\0') {
    lib = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return Status::unsupported(std::string("BRAID_CUDA_KERNELS: ") + dlerror());
  } else {
    for (const std::string& candidate : {own_directory() + kLibraryName, std::string(kLibraryName)}) {
      lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      tried += (tried.empty() ? "" : "; ") + std::string(dlerror());
    }
    if (lib == nullptr)
      return Status::unsupported(std::string("the CUDA kernel library ") + kLibraryName + " was not found (" +
                                 tried + "); it is built with libbraid when CMake finds nvcc");
  }
  k->reduce_copy = reinterpret_cast<decltype(k->reduce_copy)>(dlsym(lib, "braid_cuda_reduce_copy"));
  k->divide = reinterpret_cast<decltype(k->divide)>(dlsym(lib, "braid_cuda_divide"));
  k->preload = reinterpret_cast<decltype(k->preload)>(dlsym(lib, "braid_cuda_preload"));
  if (k->reduce_copy == nullptr || k->divide == nullptr || k->preload == nullptr)
    return Status::unsupported(
        "the CUDA kernel library lacks braid_cuda_reduce_copy, braid_cuda_divide or braid_cuda_preload");
  return Status::ok();
}

}  // namespace

Status cuda_kernels(const CudaKernels** out) {
  static std::mutex mu;
  static CudaKernels kernels;
  static Status loaded = Status::internal("not loaded");
  static bool tried = false;
  std::lock_guard<std::mutex> lock(mu);
  if (!tried) {
    tried = true;
    loaded = load(&kernels);
  }
  *out = loaded ? &kernels : nullptr;
  return loaded;
}

}  // namespace braid
