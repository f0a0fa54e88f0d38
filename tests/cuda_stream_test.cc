// Stream-ordered operations on real device memory and real CUDA streams:
// several forked ranks sharing GPU 0 (NCCL refuses that), once through CUDA
// IPC (device to device, with kernels/cuda) and once through host staging.
// Skips with a message where no GPU is usable; the GPU run is
// tools/gpu-check.sh. tests/stream_test and tests/cuda_ipc_test cover the
// same contracts everywhere through a fake driver.
#include <braid/braid.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/rank_test.h"

namespace braid::test {
namespace {

// Asked in a child: a process that initialised CUDA cannot fork ranks that
// use it, so the test process itself never touches CUDA.
bool gpu_usable() {
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 0 : 1);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

#define SKIP_WITHOUT_GPU()                                                                              \
  do {                                                                                                  \
    if (!gpu_usable()) GTEST_SKIP() << "no usable CUDA device here; the GPU run is tools/gpu-check.sh"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Each test runs on both paths; ipc says which one must have carried it.
class CudaStreams : public ::testing::TestWithParam<bool> {
 protected:
  Env env() const {
    if (GetParam()) return {{"BRAID_CUDA_KERNELS", BRAID_CUDA_KERNELS_LIB}};
    return {{"BRAID_CUDA_IPC", "0"}};
  }
};

INSTANTIATE_TEST_SUITE_P(Paths, CudaStreams, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "CudaIpc" : "HostStaging"; });

// Bytes read from peers' device memory: the whole data on the IPC path, none
// through host staging.
void expect_path(braid_comm_t comm, bool ipc, uint64_t at_least) {
  uint64_t bytes = 0;
  BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &bytes));
  if (ipc) {
    EXPECT_GE(bytes, at_least);
  } else {
    EXPECT_EQ(bytes, 0u);
  }
}

TEST_P(CudaStreams, AllReduceOnDeviceMemoryWithFourRanksOnOneGpu) {
  SKIP_WITHOUT_GPU();
  const bool ipc = GetParam();
  run_ranks(4, env(), [ipc](braid_comm_t comm, int rank, int nranks) {
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    for (size_t count : {size_t{1}, size_t{1000}, size_t{1} << 20, size_t{1} << 24}) {
      std::vector<float> host(count), out(count, -1.0f);
      for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>((rank + 1) * (i % 31));
      float *in_d = nullptr, *out_d = nullptr;
      CUDA_OK(cudaMalloc(&in_d, count * sizeof(float)));
      CUDA_OK(cudaMalloc(&out_d, count * sizeof(float)));
      CUDA_OK(cudaMemcpyAsync(in_d, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, s));
      BRAID_ASSERT_OK(braid_all_reduce(in_d, out_d, count, BRAID_FLOAT32, BRAID_SUM, comm, s));
      // In place, right behind it on the stream.
      BRAID_ASSERT_OK(braid_all_reduce(out_d, out_d, count, BRAID_FLOAT32, BRAID_MAX, comm, s));
      CUDA_OK(cudaMemcpyAsync(out.data(), out_d, count * sizeof(float), cudaMemcpyDeviceToHost, s));
      CUDA_OK(cudaStreamSynchronize(s));
      const float total = static_cast<float>(nranks * (nranks + 1) / 2);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], total * static_cast<float>(i % 31)) << count;
      CUDA_OK(cudaFree(in_d));
      CUDA_OK(cudaFree(out_d));
    }
    expect_path(comm, ipc, (size_t{1} << 24) * sizeof(float));
    CUDA_OK(cudaStreamDestroy(s));
  });
}

TEST_P(CudaStreams, EveryCollectiveAndRequestsOnDeviceMemory) {
  SKIP_WITHOUT_GPU();
  const bool ipc = GetParam();
  run_ranks(3, env(), [ipc](braid_comm_t comm, int rank, int n) {
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    const size_t c = 4099;
    std::vector<int32_t> mine(c), all(c * n, -1), bcast(c, -1);
    for (size_t i = 0; i < c; ++i) mine[i] = static_cast<int32_t>(rank * 1000003 + i);
    int32_t *mine_d = nullptr, *all_d = nullptr, *b_d = nullptr;
    CUDA_OK(cudaMalloc(&mine_d, c * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&all_d, c * n * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&b_d, c * sizeof(int32_t)));
    CUDA_OK(cudaMemcpyAsync(mine_d, mine.data(), c * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    BRAID_ASSERT_OK(braid_all_gather(mine_d, all_d, c, BRAID_INT32, comm, s));
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_ibroadcast(mine_d, b_d, c, BRAID_INT32, 2, comm, s, &req));
    BRAID_ASSERT_OK(braid_wait(&req));
    // reduce to rank 1, and reduce_scatter (max) of the gathered blocks,
    // which every rank holds alike.
    int32_t *red_d = nullptr, *rs_d = nullptr;
    CUDA_OK(cudaMalloc(&red_d, c * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&rs_d, c * sizeof(int32_t)));
    CUDA_OK(cudaMemsetAsync(red_d, 0xff, c * sizeof(int32_t), s));
    BRAID_ASSERT_OK(braid_reduce(mine_d, red_d, c, BRAID_INT32, BRAID_SUM, 1, comm, s));
    BRAID_ASSERT_OK(braid_reduce_scatter(all_d, rs_d, c, BRAID_INT32, BRAID_MAX, comm, s));
    std::vector<int32_t> red(c), rs(c);
    CUDA_OK(cudaMemcpyAsync(red.data(), red_d, c * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(rs.data(), rs_d, c * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    // Device memory in a host-ordered call: refused with a message.
    EXPECT_EQ(braid_all_reduce(mine_d, mine_d, c, BRAID_INT32, BRAID_SUM, comm, nullptr),
              BRAID_ERR_UNSUPPORTED);
    CUDA_OK(cudaMemcpyAsync(all.data(), all_d, c * n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(bcast.data(), b_d, c * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < c; ++i) ASSERT_EQ(all[p * c + i], static_cast<int32_t>(p * 1000003 + i));
    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(bcast[i], static_cast<int32_t>(2 * 1000003 + i));
      int32_t sum = 0;
      for (int p = 0; p < n; ++p) sum += static_cast<int32_t>(p * 1000003 + i);
      ASSERT_EQ(red[i], rank == 1 ? sum : -1);
      ASSERT_EQ(rs[i], static_cast<int32_t>(rank * 1000003 + i));  // every rank holds the same blocks
    }
    // gather to rank 0, scatter from rank 2 and all_to_all of the gathered
    // blocks (every rank holds the same ones, so rank r gets block r, mine,
    // from everyone).
    int32_t *ga_d = nullptr, *sc_d = nullptr, *a2a_d = nullptr;
    CUDA_OK(cudaMalloc(&ga_d, c * n * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&sc_d, c * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&a2a_d, c * n * sizeof(int32_t)));
    BRAID_ASSERT_OK(braid_gather(mine_d, ga_d, c, BRAID_INT32, 0, comm, s));
    BRAID_ASSERT_OK(braid_scatter(all_d, sc_d, c, BRAID_INT32, 2, comm, s));
    BRAID_ASSERT_OK(braid_all_to_all(all_d, a2a_d, c, BRAID_INT32, comm, s));
    std::vector<int32_t> ga(c * n), sc(c), a2a(c * n);
    CUDA_OK(cudaMemcpyAsync(ga.data(), ga_d, c * n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(sc.data(), sc_d, c * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(a2a.data(), a2a_d, c * n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(sc[i], mine[i]) << "scatter";
      for (int p = 0; p < n; ++p) {
        if (rank == 0) {
          ASSERT_EQ(ga[p * c + i], static_cast<int32_t>(p * 1000003 + i)) << "gather";
        }
        ASSERT_EQ(a2a[p * c + i], mine[i]) << "all_to_all";
      }
    }
    expect_path(comm, ipc, c * sizeof(int32_t));
    CUDA_OK(cudaFree(ga_d));
    CUDA_OK(cudaFree(sc_d));
    CUDA_OK(cudaFree(a2a_d));
    CUDA_OK(cudaFree(red_d));
    CUDA_OK(cudaFree(rs_d));
    CUDA_OK(cudaFree(mine_d));
    CUDA_OK(cudaFree(all_d));
    CUDA_OK(cudaFree(b_d));
    CUDA_OK(cudaStreamDestroy(s));
  });
}

}  // namespace
}  // namespace braid::test
