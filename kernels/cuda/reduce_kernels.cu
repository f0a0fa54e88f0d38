// Device reduction kernels: one template per (element policy, op), k sources
// to m destinations in one pass. Each thread takes 16-byte packs in a
// grid-stride loop (every pointer 16-byte aligned), then single elements for
// the tail, or for everything when some pointer is not aligned.
#include "kernels/cuda/reduce_kernels.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/element_math.h"

namespace braid::cuda {
namespace {

constexpr int kMaxSources = BRAID_CUDA_MAX_SOURCES;
constexpr int kMaxDestinations = BRAID_CUDA_MAX_DESTINATIONS;

namespace m = braid::cuda_math;

struct Args {
  const void* srcs[kMaxSources];
  void* dsts[kMaxDestinations];
  int nsrcs;
  int ndsts;
  uint64_t count;
  uint64_t npacks;  // 16-byte packs taken as packs; 0 when some pointer is unaligned
};

template <class S>
union Pack {
  uint4 v;
  S e[16 / sizeof(S)];
};

template <class E, class Op>
__global__ void reduce_copy_kernel(Args a, Op op) {
  using S = typename E::Stored;
  constexpr int kPer = 16 / sizeof(S);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint64_t p = first; p < a.npacks; p += stride) {
    Pack<S> in;
    typename E::Compute acc[kPer];
    in.v = static_cast<const uint4*>(a.srcs[0])[p];
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] = E::load(in.e[j]);
    for (int s = 1; s < a.nsrcs; ++s) {
      in.v = static_cast<const uint4*>(a.srcs[s])[p];
#pragma unroll
      for (int j = 0; j < kPer; ++j) op(acc[j], E::load(in.e[j]));
    }
    Pack<S> out;
#pragma unroll
    for (int j = 0; j < kPer; ++j) out.e[j] = E::store(acc[j]);
    for (int d = 0; d < a.ndsts; ++d) static_cast<uint4*>(a.dsts[d])[p] = out.v;
  }
  const S* srcs[kMaxSources];
  for (int s = 0; s < a.nsrcs; ++s) srcs[s] = static_cast<const S*>(a.srcs[s]);
  for (uint64_t i = a.npacks * kPer + first; i < a.count; i += stride) {
    const S r = m::reduce_element<E>(srcs, a.nsrcs, i, op);
    for (int d = 0; d < a.ndsts; ++d) static_cast<S*>(a.dsts[d])[i] = r;
  }
}

template <class E>
__global__ void divide_kernel(const typename E::Stored* in, typename E::Stored* out, uint64_t count,
                              int divisor) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    out[i] = m::divide_element<E>(in[i], divisor);
}

constexpr int kThreads = 512;

// The outcome of a call: a code and, on failure, its message.
struct Result {
  braid_result_t code = BRAID_SUCCESS;
  char message[200] = {};
};

Result fail(braid_result_t code, const char* format, ...) __attribute__((format(printf, 2, 3)));
Result fail(braid_result_t code, const char* format, ...) {
  Result r;
  r.code = code;
  va_list args;
  va_start(args, format);
  std::vsnprintf(r.message, sizeof(r.message), format, args);
  va_end(args);
  return r;
}

Result cuda_failed(const char* what, cudaError_t err) {
  return fail(BRAID_ERR_SYSTEM, "CUDA %s failed: %s (%s)", what, cudaGetErrorName(err),
              cudaGetErrorString(err));
}

braid_result_t report(const Result& r, char* error, size_t error_size) {
  if (error != nullptr && error_size > 0) std::snprintf(error, error_size, "%s", r.message);
  return r.code;
}

// Enough blocks to fill the device several times over; the grid-stride loops
// take the rest. Multiprocessor counts are read once per device.
Result grid_for(uint64_t work_items, unsigned* blocks) {
  static std::atomic<int> sm_count[64];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_failed("cudaGetDevice", err);
  int sms = device >= 0 && device < 64 ? sm_count[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return cuda_failed("cudaDeviceGetAttribute", err);
    if (device >= 0 && device < 64) sm_count[device].store(sms, std::memory_order_relaxed);
  }
  const uint64_t wanted = (work_items + kThreads - 1) / kThreads;
  const uint64_t cap = static_cast<uint64_t>(sms) * 8;
  *blocks = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
  return Result{};
}

Result launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Result{} : cuda_failed(what, err);
}

template <class E, class Op>
Result launch(Args a, cudaStream_t stream) {
  using S = typename E::Stored;
  if (a.count == 0) return Result{};
  bool aligned = true;
  for (int s = 0; s < a.nsrcs; ++s) aligned &= reinterpret_cast<uintptr_t>(a.srcs[s]) % 16 == 0;
  for (int d = 0; d < a.ndsts; ++d) aligned &= reinterpret_cast<uintptr_t>(a.dsts[d]) % 16 == 0;
  a.npacks = aligned ? a.count * sizeof(S) / 16 : 0;
  const uint64_t tail = a.count - a.npacks * (16 / sizeof(S));
  unsigned blocks = 0;
  Result r = grid_for(a.npacks > tail ? a.npacks : tail, &blocks);
  if (r.code != BRAID_SUCCESS) return r;
  (void)cudaGetLastError();  // an earlier call's error on this thread is not this launch's
  reduce_copy_kernel<E, Op><<<blocks, kThreads, 0, stream>>>(a, Op{});
  return launched("kernel launch (reduce_copy)");
}

Result reduce_copy(braid_dtype_t dtype, braid_redop_t op, const void* const* srcs, int nsrcs,
                   void* const* dsts, int ndsts, size_t count, cudaStream_t stream) {
  if (nsrcs < 1 || nsrcs > kMaxSources)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: %d sources (1 to %d)", nsrcs, kMaxSources);
  if (ndsts < 1 || ndsts > kMaxDestinations)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: %d destinations (1 to %d)", ndsts,
                kMaxDestinations);
  if (srcs == nullptr || dsts == nullptr)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: srcs or dsts is NULL");
  Args a{};
  a.nsrcs = nsrcs;
  a.ndsts = ndsts;
  a.count = count;
  for (int s = 0; s < nsrcs; ++s) {
    if (srcs[s] == nullptr && count > 0)
      return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: source %d is NULL", s);
    a.srcs[s] = srcs[s];
  }
  for (int d = 0; d < ndsts; ++d) {
    if (dsts[d] == nullptr && count > 0)
      return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: destination %d is NULL", d);
    a.dsts[d] = dsts[d];
  }
  Result r;
  bool defined = false;
  const bool known = m::visit_element(dtype, [&](auto e) {
    using E = decltype(e);
    defined = m::visit_op<E>(op, [&](auto o) { r = launch<E, decltype(o)>(a, stream); });
  });
  if (!known)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: unknown dtype %d", static_cast<int>(dtype));
  if (!defined)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "reduce_copy: reduction %d is not defined for dtype %d",
                static_cast<int>(op), static_cast<int>(dtype));
  return r;
}

Result divide(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor,
              cudaStream_t stream) {
  if (divisor == 0) return fail(BRAID_ERR_INVALID_ARGUMENT, "divide: divisor is 0");
  if ((in == nullptr || out == nullptr) && count > 0)
    return fail(BRAID_ERR_INVALID_ARGUMENT, "divide: %s is NULL", in == nullptr ? "in" : "out");
  Result r = fail(BRAID_ERR_INVALID_ARGUMENT, "divide: dtype %d is not floating", static_cast<int>(dtype));
  m::visit_element(dtype, [&](auto e) {
    using E = decltype(e);
    if constexpr (!std::is_integral_v<typename E::Compute>) {
      r = Result{};
      if (count == 0) return;
      unsigned blocks = 0;
      r = grid_for(count, &blocks);
      if (r.code != BRAID_SUCCESS) return;
      (void)cudaGetLastError();  // an earlier call's error on this thread is not this launch's
      divide_kernel<E><<<blocks, kThreads, 0, stream>>>(
          static_cast<const typename E::Stored*>(in), static_cast<typename E::Stored*>(out), count, divisor);
      r = launched("kernel launch (divide)");
    }
  });
  return r;
}

// Every kernel instantiation loaded now: with lazy loading (the default
// since CUDA 12.2) the first launch of each would load its code then, and
// loading may synchronise the context, which waits on every stream.
Result preload() {
  Result r;
  for (int d = 0; d < BRAID_NUM_DTYPES && r.code == BRAID_SUCCESS; ++d) {
    const auto dtype = static_cast<braid_dtype_t>(d);
    m::visit_element(dtype, [&](auto e) {
      using E = decltype(e);
      for (int o = 0; o < BRAID_NUM_OPS && r.code == BRAID_SUCCESS; ++o)
        m::visit_op<E>(static_cast<braid_redop_t>(o), [&](auto op) {
          cudaFuncAttributes attr{};
          const cudaError_t err = cudaFuncGetAttributes(&attr, reduce_copy_kernel<E, decltype(op)>);
          if (err != cudaSuccess) r = cuda_failed("cudaFuncGetAttributes (reduce_copy)", err);
        });
      if constexpr (!std::is_integral_v<typename E::Compute>) {
        cudaFuncAttributes attr{};
        const cudaError_t err = cudaFuncGetAttributes(&attr, divide_kernel<E>);
        if (err != cudaSuccess && r.code == BRAID_SUCCESS)
          r = cuda_failed("cudaFuncGetAttributes (divide)", err);
      }
    });
  }
  return r;
}

}  // namespace
}  // namespace braid::cuda

extern "C" BRAID_CUDA_API braid_result_t braid_cuda_preload(char* error, size_t error_size) {
  return braid::cuda::report(braid::cuda::preload(), error, error_size);
}

extern "C" BRAID_CUDA_API braid_result_t braid_cuda_reduce_copy(braid_dtype_t dtype, braid_redop_t op,
                                                                const void* const* srcs, int nsrcs,
                                                                void* const* dsts, int ndsts, size_t count,
                                                                struct CUstream_st* stream, char* error,
                                                                size_t error_size) {
  return braid::cuda::report(braid::cuda::reduce_copy(dtype, op, srcs, nsrcs, dsts, ndsts, count, stream),
                             error, error_size);
}

extern "C" BRAID_CUDA_API braid_result_t braid_cuda_divide(braid_dtype_t dtype, const void* in, void* out,
                                                           size_t count, int divisor,
                                                           struct CUstream_st* stream, char* error,
                                                           size_t error_size) {
  return braid::cuda::report(braid::cuda::divide(dtype, in, out, count, divisor, stream), error, error_size);
}
