// The CUDA reduction kernels against the device's own copy, on one GPU.
//
//   build/bench/cuda_kernel_bench [--bytes N] [--iters K]
//
// Bytes count what moves through memory: cudaMemcpy device-to-device reads
// and writes the buffer (2 x size), a two-input reduction reads two buffers
// and writes one (3 x size), so "% of copy" compares like with like (the
// issue's target: at least 90% at 1 GiB for fp32 and bf16 sum). Each kernel's
// result is checked against kernels/cpu on the first elements before it is
// timed. Exits 1 with a message where there is no GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/flags.h"
#include "kernels/cpu/reduce_kernels.h"
#include "kernels/cuda/reduce_kernels.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "cuda_kernel_bench: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

// Milliseconds per call of fn, timed with events over `iters` calls after one warm-up.
template <class Fn>
float time_ms(int iters, Fn fn) {
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  fn();
  check_cuda(cudaEventRecord(start), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) fn();
  check_cuda(cudaEventRecord(stop), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / static_cast<float>(iters);
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = size_t{1} << 30;
  long iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (flag == "--bytes" && value != nullptr && braid_bench::parse_size(value, &bytes) && bytes >= 16) {
      ++i;
    } else if (flag == "--iters" && value != nullptr && braid_bench::parse_long(value, 1, 100000, &iters)) {
      ++i;
    } else {
      std::fprintf(
          stderr,
          "cuda_kernel_bench: bad argument '%s'\nusage: cuda_kernel_bench [--bytes SIZE (>= 16, K/M/G "
          "suffixes)] [--iters 1..100000]\n",
          argv[i]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_kernel_bench: no usable CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  void *a = nullptr, *b = nullptr, *c = nullptr;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&c, bytes), "cudaMalloc");
  const int n = static_cast<int>(iters);
  const float copy_ms =
      time_ms(n, [&] { check_cuda(cudaMemcpyAsync(c, a, bytes, cudaMemcpyDeviceToDevice), "copy"); });
  const double copy_gbs = 2.0 * static_cast<double>(bytes) / (copy_ms * 1e6);
  std::printf("# %s, %.0f MiB buffers, %d calls each; GB/s counts bytes read + written\n", prop.name,
              static_cast<double>(bytes) / (1 << 20), n);
  std::printf("%-28s %10s %10s %10s\n", "kernel", "ms", "GB/s", "% of copy");
  std::printf("%-28s %10.3f %10.1f %10.1f\n", "cudaMemcpy (device to device)", copy_ms, copy_gbs, 100.0);
  struct Case {
    braid_dtype_t dtype;
    braid_redop_t op;
    int nsrcs;
  };
  const Case cases[] = {{BRAID_FLOAT32, BRAID_SUM, 1},  {BRAID_FLOAT32, BRAID_SUM, 2},
                        {BRAID_BFLOAT16, BRAID_SUM, 2}, {BRAID_FLOAT16, BRAID_SUM, 2},
                        {BRAID_FLOAT32, BRAID_MAX, 2},  {BRAID_INT32, BRAID_SUM, 2},
                        {BRAID_FLOAT64, BRAID_SUM, 2}};
  bool all_right = true;
  for (const Case& k : cases) {
    const size_t esize = braid_dtype_size(k.dtype), count = bytes / esize;
    // Inputs: a holds 1.0-ish patterns, b another; check the first 4096 elements.
    const size_t probe = count < 4096 ? count : 4096;
    std::vector<unsigned char> ha(probe * esize), hb(probe * esize), want(probe * esize), got(probe * esize);
    for (size_t i = 0; i < ha.size(); ++i) {
      ha[i] = static_cast<unsigned char>(i * 7 + 3);
      hb[i] = static_cast<unsigned char>(i * 13 + 5);
    }
    if (k.dtype == BRAID_FLOAT16 || k.dtype == BRAID_BFLOAT16 || k.dtype == BRAID_FLOAT32 ||
        k.dtype == BRAID_FLOAT64) {
      // Finite values, so the check compares numbers, not NaN payloads.
      for (size_t i = 0; i < probe; ++i) {
        const float x = static_cast<float>(i % 97) * 0.25f, y = static_cast<float>(i % 31) * -0.5f;
        if (k.dtype == BRAID_FLOAT16 || k.dtype == BRAID_BFLOAT16) {
          const uint16_t hx = k.dtype == BRAID_FLOAT16 ? braid::kernels::float_to_half(x)
                                                       : braid::kernels::float_to_bfloat16(x);
          const uint16_t hy = k.dtype == BRAID_FLOAT16 ? braid::kernels::float_to_half(y)
                                                       : braid::kernels::float_to_bfloat16(y);
          std::memcpy(&ha[2 * i], &hx, 2);
          std::memcpy(&hb[2 * i], &hy, 2);
        } else if (k.dtype == BRAID_FLOAT32) {
          std::memcpy(&ha[4 * i], &x, 4);
          std::memcpy(&hb[4 * i], &y, 4);
        } else {
          const double dx = x, dy = y;
          std::memcpy(&ha[8 * i], &dx, 8);
          std::memcpy(&hb[8 * i], &dy, 8);
        }
      }
    }
    check_cuda(cudaMemcpy(a, ha.data(), ha.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    check_cuda(cudaMemcpy(b, hb.data(), hb.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    const void* srcs[2] = {a, b};
    void* dsts[1] = {c};
    char error[256] = {};
    auto run = [&] {
      if (braid_cuda_reduce_copy(k.dtype, k.op, srcs, k.nsrcs, dsts, 1, count, nullptr, error,
                                 sizeof(error)) != BRAID_SUCCESS) {
        std::fprintf(stderr, "cuda_kernel_bench: %s\n", error);
        std::exit(1);
      }
    };
    run();
    check_cuda(cudaDeviceSynchronize(), "reduce_copy");
    check_cuda(cudaMemcpy(got.data(), c, got.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    want = ha;
    if (k.nsrcs == 2) braid::kernels::reduce(k.dtype, k.op, want.data(), ha.data(), hb.data(), probe);
    const bool right = want == got;
    all_right &= right;
    const float ms = time_ms(n, run);
    const double moved = static_cast<double>(k.nsrcs + 1) * static_cast<double>(count * esize);
    const double gbs = moved / (ms * 1e6);
    const std::string label =
        std::string(braid_dtype_name(k.dtype)) + " " +
        (k.nsrcs == 1 ? "copy" : (k.op == BRAID_SUM ? "sum" : (k.op == BRAID_MAX ? "max" : "op"))) + " (" +
        std::to_string(k.nsrcs) + " in, 1 out)";
    std::printf("%-28s %10.3f %10.1f %10.1f%s\n", label.c_str(), ms, gbs, 100.0 * gbs / copy_gbs,
                right ? "" : "   WRONG RESULT");
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return all_right ? 0 : 1;
}
