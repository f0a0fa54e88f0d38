// cuda_stream_bench: stream-ordered all_reduce on device memory, several
// forked ranks sharing GPU 0, beside the device's own copy bandwidth
// measured in the same run, through CUDA IPC (device to device) and through
// host staging (BRAID_CUDA_IPC=0), one table each. Each rank enqueues
// `iters` all_reduces on its stream and synchronises; rank 0 prints one row
// per size (nccl-tests' busbw = algbw * 2(n-1)/n) and busbw as a share of
// the copy bandwidth (bytes read + written by cudaMemcpy device to device).
// The results are checked once per size. Needs a GPU; tools/gpu-check.sh
// runs it.
//
//   cuda_stream_bench [--ranks 4] [-b 1M] [-e 256M] [-f 4] [-n 10] [--path both|ipc|staging]
#include <braid/braid.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <time.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/flags.h"
#include "tools/launcher/fork_ranks.h"

namespace {

double now_s() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Device-to-device copy bandwidth for `bytes`, counting bytes read and written.
double copy_gbps(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
  cudaStreamSynchronize(s);
  const int reps = 10;
  const double t0 = now_s();
  for (int i = 0; i < reps; ++i) cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
  cudaStreamSynchronize(s);
  return 2.0 * static_cast<double>(bytes) * reps / (now_s() - t0) / 1e9;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "cuda_stream_bench: %s\nusage: cuda_stream_bench [--ranks N] [-b MIN] [-e MAX] [-f FACTOR] "
               "[-n ITERS] [--path both|ipc|staging]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  long ranks = 4, factor = 4, iters = 10;
  size_t min_bytes = 1 << 20, max_bytes = 256u << 20;
  std::string path = "both";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("missing value after " + a).c_str());
    const char* v = argv[++i];
    bool ok = false;
    if (a == "--ranks")
      ok = braid_bench::parse_long(v, 1, 64, &ranks);
    else if (a == "-b")
      ok = braid_bench::parse_size(v, &min_bytes);
    else if (a == "-e")
      ok = braid_bench::parse_size(v, &max_bytes);
    else if (a == "-f")
      ok = braid_bench::parse_long(v, 2, 1024, &factor);
    else if (a == "-n")
      ok = braid_bench::parse_long(v, 1, 100000, &iters);
    else if (a == "--path")
      ok = (path = v) == "both" || path == "ipc" || path == "staging";
    else
      return usage(("unknown flag " + a).c_str());
    if (!ok) return usage(("bad value for " + a + ": " + v).c_str());
  }
  if (min_bytes < 4 || max_bytes < min_bytes) return usage("need 4 <= -b <= -e");

  std::vector<bool> paths;  // true: CUDA IPC
  if (path != "staging") paths.push_back(true);
  if (path != "ipc") paths.push_back(false);
  for (const bool ipc : paths) {
    // Rows come from rank 0 in its process; failures from any rank's exit code.
    braid::launcher::LaunchOptions o;
    o.nranks = static_cast<int>(ranks);
    o.timeout_s = 600;
    o.env = {{"BRAID_CUDA_IPC", ipc ? "1" : "0"}};
    auto result = braid::launcher::fork_ranks(o, [&](braid_comm_t comm, int rank, int n,
                                                     const braid_unique_id_t&) {
      if (cudaSetDevice(0) != cudaSuccess) {
        if (rank == 0) std::fprintf(stderr, "cuda_stream_bench: no usable CUDA device\n");
        return 3;
      }
      cudaStream_t s;
      float *in = nullptr, *out = nullptr;
      if (cudaStreamCreate(&s) != cudaSuccess || cudaMalloc(&in, max_bytes) != cudaSuccess ||
          cudaMalloc(&out, max_bytes) != cudaSuccess) {
        std::fprintf(stderr, "rank %d: cudaMalloc of 2 x %zu bytes failed\n", rank, max_bytes);
        return 4;
      }
      if (rank == 0) {
        std::printf("# cuda_stream_bench: %d ranks on GPU 0, float32 sum, stream-ordered (%s), %ld iters\n",
                    n, ipc ? "CUDA IPC" : "host staging", iters);
        std::printf("# %12s %12s %10s %10s %12s %10s\n", "size(B)", "time(us)", "algbw", "busbw", "copy GB/s",
                    "busbw/copy");
      }
      for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= static_cast<size_t>(factor)) {
        const size_t count = bytes / sizeof(float);
        std::vector<float> host(count, static_cast<float>(rank + 1));
        cudaMemcpy(in, host.data(), count * sizeof(float), cudaMemcpyHostToDevice);
        // Warm-up and check.
        if (braid_all_reduce(in, out, count, BRAID_FLOAT32, BRAID_SUM, comm, s) != BRAID_SUCCESS) {
          std::fprintf(stderr, "rank %d: %s\n", rank, braid_get_last_error());
          return 5;
        }
        cudaMemcpyAsync(host.data(), out, count * sizeof(float), cudaMemcpyDeviceToHost, s);
        cudaStreamSynchronize(s);
        const float want = static_cast<float>(n * (n + 1) / 2);
        for (size_t i = 0; i < count; i += 997) {
          if (host[i] != want) {
            std::fprintf(stderr, "rank %d: wrong result at %zu of %zu: %g, expected %g\n", rank, i, count,
                         static_cast<double>(host[i]), static_cast<double>(want));
            return 6;
          }
        }
        braid_barrier(comm, nullptr);
        const double t0 = now_s();
        for (long it = 0; it < iters; ++it)
          braid_all_reduce(in, out, count, BRAID_FLOAT32, BRAID_SUM, comm, s);
        cudaStreamSynchronize(s);
        const double t = (now_s() - t0) / static_cast<double>(iters);
        braid_result_t async = BRAID_SUCCESS;
        braid_comm_get_async_error(comm, &async);
        if (async != BRAID_SUCCESS) {
          std::fprintf(stderr, "rank %d: %s\n", rank, braid_comm_get_last_error(comm));
          return 7;
        }
        braid_barrier(comm, nullptr);
        uint64_t ipc_bytes = 0;
        braid_comm_transport_bytes(comm, "cuda_ipc", &ipc_bytes);
        if (ipc && ipc_bytes == 0) {
          std::fprintf(stderr, "rank %d: CUDA IPC was asked for but not used (the log says why)\n", rank);
          return 8;
        }
        if (rank == 0) {
          const double algbw = static_cast<double>(bytes) / t / 1e9;
          const double busbw = algbw * 2.0 * (n - 1) / n;
          const double copy = copy_gbps(out, in, bytes, s);
          std::printf("  %12zu %12.1f %10.2f %10.2f %12.1f %9.1f%%\n", bytes, t * 1e6, algbw, busbw, copy,
                      100.0 * busbw / copy);
          std::fflush(stdout);
        }
        braid_barrier(comm, nullptr);
      }
      cudaFree(in);
      cudaFree(out);
      cudaStreamDestroy(s);
      return 0;
    });
    if (!result.ok()) {
      std::fprintf(stderr, "cuda_stream_bench: %s\n", result.describe().c_str());
      return 1;
    }
  }
  return 0;
}
