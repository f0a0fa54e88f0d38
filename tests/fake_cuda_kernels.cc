// A stand-in for libbraid_cuda (kernels/cuda/reduce_kernels.h) over the fake
// driver (tests/fake_libcuda.cc): each "kernel" is a host function on the
// fake stream that does kernels/cpu's math, in stream order with the copies.
// With it, the CUDA IPC path runs across forked ranks without a GPU; the real
// kernels are held to the same math by tests/cuda_kernels_test.
#include <braid/braid.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/reduce_kernels.h"
#include "kernels/cuda/reduce_kernels.h"
#include "src/core/dtype.h"

namespace {

// The fake driver's, which the test loaded first (RTLD_GLOBAL).
int launch_host_func(void* stream, void (*fn)(void*), void* data) {
  using Launch = int (*)(void*, void (*)(void*), void*);
  static Launch launch = reinterpret_cast<Launch>(dlsym(RTLD_DEFAULT, "cuLaunchHostFunc"));
  return launch != nullptr ? launch(stream, fn, data) : 1;
}

struct ReduceCopy {
  braid_dtype_t dtype;
  braid_redop_t op;
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  size_t count;
  // As the device kernel, every element is read from every source before
  // any destination is written: a destination may be a source.
  static void run(void* p) {
    auto* j = static_cast<ReduceCopy*>(p);
    const size_t bytes = j->count * braid::dtype_size(j->dtype);
    std::vector<char> acc(bytes);
    std::memcpy(acc.data(), j->srcs[0], bytes);
    for (size_t i = 1; i < j->srcs.size(); ++i)
      braid::kernels::reduce(j->dtype, j->op, acc.data(), acc.data(), j->srcs[i], j->count);
    for (void* d : j->dsts) std::memcpy(d, acc.data(), bytes);
    delete j;
  }
};

struct Divide {
  braid_dtype_t dtype;
  const void* in;
  void* out;
  size_t count;
  int divisor;
  static void run(void* p) {
    auto* j = static_cast<Divide*>(p);
    braid::kernels::divide(j->dtype, j->in, j->out, j->count, j->divisor);
    delete j;
  }
};

braid_result_t fail(char* error, size_t size, const std::string& what) {
  if (error != nullptr && size > 0) {
    std::strncpy(error, what.c_str(), size - 1);
    error[size - 1] = '\0';
  }
  return BRAID_ERR_INVALID_ARGUMENT;
}

}  // namespace

extern "C" {

BRAID_CUDA_API braid_result_t braid_cuda_reduce_copy(braid_dtype_t dtype, braid_redop_t op,
                                                     const void* const* srcs, int nsrcs, void* const* dsts,
                                                     int ndsts, size_t count, struct CUstream_st* stream,
                                                     char* error, size_t error_size) {
  if (nsrcs < 1 || nsrcs > BRAID_CUDA_MAX_SOURCES || ndsts < 1 || ndsts > BRAID_CUDA_MAX_DESTINATIONS)
    return fail(error, error_size, "nsrcs=" + std::to_string(nsrcs) + ", ndsts=" + std::to_string(ndsts));
  if (count == 0) return BRAID_SUCCESS;
  auto* job = new ReduceCopy{dtype, op, std::vector<const void*>(srcs, srcs + nsrcs),
                             std::vector<void*>(dsts, dsts + ndsts), count};
  if (launch_host_func(stream, &ReduceCopy::run, job) != 0) {
    delete job;
    return fail(error, error_size, "not a stream of the fake driver");
  }
  return BRAID_SUCCESS;
}

// Nothing to load: the "kernels" are host code. Counted, so a test can see
// that braid preloads before its first launch (atomic: ranks that are threads
// of one process preload at once).
std::atomic<int> g_preloads{0};
BRAID_CUDA_API braid_result_t braid_cuda_preload(char*, size_t) {
  ++g_preloads;
  return BRAID_SUCCESS;
}
BRAID_CUDA_API int fake_cuda_kernel_preloads() {
  return g_preloads;
}

BRAID_CUDA_API braid_result_t braid_cuda_divide(braid_dtype_t dtype, const void* in, void* out, size_t count,
                                                int divisor, struct CUstream_st* stream, char* error,
                                                size_t error_size) {
  if (count == 0) return BRAID_SUCCESS;
  auto* job = new Divide{dtype, in, out, count, divisor};
  if (launch_host_func(stream, &Divide::run, job) != 0) {
    delete job;
    return fail(error, error_size, "not a stream of the fake driver");
  }
  return BRAID_SUCCESS;
}

}  // extern "C"
