// Device collectives through CUDA IPC (transports/cuda/ipc_window.h,
// src/algo/ipc_collectives.h) across real forked ranks, through the fake
// driver (tests/fake_libcuda.cc: device memory other processes map through
// the IPC calls, streams that are threads) and a fake kernel library
// (tests/fake_cuda_kernels.cc: kernels/cpu's math on those streams). The
// data really crosses processes through the mapped windows, so a phase
// that is not ordered shows as wrong results; FAKE_CUDA_JITTER_US shuffles
// the streams' timing to make such races likely. What is checked: exact
// results of every collective that takes the path, in several chunks and
// in place; stream order; the windows mapped at the first call and
// unmapped and freed in step at destroy (never freed while a peer maps
// them); the fallback to host staging when a rank cannot map a window;
// mismatched paths; a dead peer.
#include <braid/braid.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/fake_cuda.h"
#include "tests/rank_test.h"
#include "transports/cuda/cuda_driver.h"
#include "transports/cuda/ipc_window.h"

namespace braid::test {
namespace {

// Small windows, so that a few thousand elements take several chunks, and
// jittered streams.
Env ipc_env(Env extra = {}) {
  Env e = {{"BRAID_CUDA_KERNELS", BRAID_FAKE_CUDA_KERNELS},
           {"BRAID_CUDA_CHUNK_BYTES", "64K"},
           {"FAKE_CUDA_JITTER_US", "30"}};
  e.insert(e.end(), extra.begin(), extra.end());
  return e;
}

// Every window this rank made is freed and every peer's unmapped, and no
// memory was freed while another process mapped it.
void expect_windows_given_back() {
  const FakeCuda& cu = fake_cuda();
  EXPECT_EQ(cu.live_allocs(), 0);
  EXPECT_EQ(cu.live_imports(), 0);
  EXPECT_EQ(cu.violations(), 0);
}

int32_t val(int rank, size_t i) {
  return static_cast<int32_t>((rank + 1) * 1000 + static_cast<int>(i % 997));
}

// All eight collectives that take CUDA IPC, on device buffers, checked
// element by element; counts from 1 element to several 64 KiB chunks.
// `through_ipc`: the communicator's windows are up (else host staging).
void run_every_collective(braid_comm_t comm, int rank, int n, void* s, bool through_ipc = true) {
  const FakeCuda& cu = fake_cuda();
  for (size_t c : {size_t{1}, size_t{5}, size_t{1000}, size_t{40000}}) {
    SCOPED_TRACE("count " + std::to_string(c));
    Buffer<int32_t> in(true, c * n, 0), out(true, c * n, -1), inplace(true, c * n, 0);
    for (size_t i = 0; i < c * n; ++i) in[i] = inplace[i] = val(rank, i);
    // all_reduce out of place (sum) and in place (max), then reduce to the
    // last rank, broadcast from rank 1, all_gather and reduce_scatter:
    // enqueued back to back on the one stream.
    BRAID_ASSERT_OK(braid_all_reduce(in.data(), out.data(), c, BRAID_INT32, BRAID_SUM, comm, s));
    BRAID_ASSERT_OK(braid_all_reduce(inplace.data(), inplace.data(), c, BRAID_INT32, BRAID_MAX, comm, s));
    Buffer<int32_t> red(true, c, -1), bc(true, c, -1), ag(true, c * n, -1), rs(true, c, -1);
    BRAID_ASSERT_OK(braid_reduce(in.data(), red.data(), c, BRAID_INT32, BRAID_PROD, n - 1, comm, s));
    BRAID_ASSERT_OK(braid_broadcast(in.data(), bc.data(), c, BRAID_INT32, 1, comm, s));
    BRAID_ASSERT_OK(braid_all_gather(in.data(), ag.data(), c, BRAID_INT32, comm, s));
    BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), rs.data(), c, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    for (size_t i = 0; i < c; ++i) {
      int32_t sum = 0, rsum = 0;
      uint32_t prod = 1;  // integers wrap, as braid's kernels do (unsigned: defined here)
      for (int p = 0; p < n; ++p) {
        sum += val(p, i);
        prod *= static_cast<uint32_t>(val(p, i));
        rsum += val(p, rank * c + i);
      }
      ASSERT_EQ(out[i], sum) << "all_reduce at " << i;
      ASSERT_EQ(inplace[i], val(n - 1, i)) << "in-place all_reduce at " << i;
      ASSERT_EQ(red[i], rank == n - 1 ? static_cast<int32_t>(prod) : -1) << "reduce at " << i;
      ASSERT_EQ(bc[i], val(1, i)) << "broadcast at " << i;
      ASSERT_EQ(rs[i], rsum) << "reduce_scatter at " << i;
      for (int p = 0; p < n; ++p)
        ASSERT_EQ(ag[p * c + i], val(p, i)) << "all_gather from " << p << " at " << i;
    }
    // gather to rank 0, scatter from the last rank, all_to_all out of place
    // and in place. Element i of the block rank p sends to rank q is
    // val(p, q * c + i).
    Buffer<int32_t> ga(true, c * n, -1), sc(true, c, -1), a2a(true, c * n, -1), a2ai(true, c * n, 0);
    for (size_t i = 0; i < c * n; ++i) a2ai[i] = val(rank, i);
    // Each call, once its stream ran, read at least `from_peers` bytes from
    // peers' windows (where they are up): it went through them.
    auto through_windows = [&](const char* what, size_t from_peers, auto call) {
      uint64_t before = 0, after = 0;
      BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &before));
      BRAID_ASSERT_OK(call());
      cu.stream_synchronize(s);
      BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &after));
      if (through_ipc) {
        EXPECT_GE(after - before, from_peers) << what;
      }
    };
    const size_t block_bytes = c * sizeof(int32_t), peers = static_cast<size_t>(n - 1);
    through_windows("gather", rank == 0 ? peers * block_bytes : 0,
                    [&] { return braid_gather(in.data(), ga.data(), c, BRAID_INT32, 0, comm, s); });
    through_windows("scatter", rank == n - 1 ? 0 : block_bytes,
                    [&] { return braid_scatter(in.data(), sc.data(), c, BRAID_INT32, n - 1, comm, s); });
    through_windows("all_to_all", peers * block_bytes,
                    [&] { return braid_all_to_all(in.data(), a2a.data(), c, BRAID_INT32, comm, s); });
    through_windows("in-place all_to_all", peers * block_bytes,
                    [&] { return braid_all_to_all(a2ai.data(), a2ai.data(), c, BRAID_INT32, comm, s); });
    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(sc[i], val(n - 1, rank * c + i)) << "scatter at " << i;
      for (int p = 0; p < n; ++p) {
        ASSERT_EQ(ga[p * c + i], rank == 0 ? val(p, i) : -1) << "gather from " << p << " at " << i;
        ASSERT_EQ(a2a[p * c + i], val(p, rank * c + i)) << "all_to_all from " << p << " at " << i;
        ASSERT_EQ(a2ai[p * c + i], val(p, rank * c + i)) << "in-place all_to_all from " << p << " at " << i;
      }
    }
    // The canonical in-place layouts of gather and scatter at their roots.
    Buffer<int32_t> gai(true, c * n, -1), sci(true, c * n, -1);
    for (size_t i = 0; i < c; ++i) gai[rank * c + i] = val(rank, i);
    for (size_t i = 0; i < c * n; ++i) sci[i] = val(rank, i);
    const int groot = n - 1, sroot = 0;
    BRAID_ASSERT_OK(braid_gather(gai.data() + rank * c, gai.data(), c, BRAID_INT32, groot, comm, s));
    BRAID_ASSERT_OK(braid_scatter(sci.data(), rank == sroot ? sci.data() + rank * c : sc.data(), c,
                                  BRAID_INT32, sroot, comm, s));
    cu.stream_synchronize(s);
    for (size_t i = 0; i < c; ++i) {
      if (rank == sroot) {
        ASSERT_EQ(sci[rank * c + i], val(rank, rank * c + i)) << "in-place scatter at " << i;
      } else {
        ASSERT_EQ(sc[i], val(sroot, rank * c + i)) << "scatter at " << i;
      }
      if (rank == groot) {
        for (int p = 0; p < n; ++p) ASSERT_EQ(gai[p * c + i], val(p, i)) << "in-place gather from " << p;
      }
    }
    // The canonical in-place layouts of all_gather and reduce_scatter.
    Buffer<int32_t> agi(true, c * n, -1), rsi(true, c * n, 0);
    for (size_t i = 0; i < c; ++i) agi[rank * c + i] = val(rank, i);
    for (size_t i = 0; i < c * n; ++i) rsi[i] = val(rank, i);
    BRAID_ASSERT_OK(braid_all_gather(agi.data() + rank * c, agi.data(), c, BRAID_INT32, comm, s));
    BRAID_ASSERT_OK(
        braid_reduce_scatter(rsi.data(), rsi.data() + rank * c, c, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    for (size_t i = 0; i < c; ++i) {
      int32_t rsum = 0;
      for (int p = 0; p < n; ++p) rsum += val(p, rank * c + i);
      ASSERT_EQ(rsi[rank * c + i], rsum) << "in-place reduce_scatter at " << i;
      for (int p = 0; p < n; ++p) ASSERT_EQ(agi[p * c + i], val(p, i)) << "in-place all_gather at " << i;
    }
  }
}

TEST(CudaIpc, EveryCollectiveIsExactAcrossChunks) {
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    run_ranks(n, ipc_env(), [](braid_comm_t comm, int rank, int nranks) {
      const FakeCuda& cu = fake_cuda();
      void* s = cu.stream_create();
      run_every_collective(comm, rank, nranks, s);
      // Every peer's window is mapped here, and the data came through them.
      EXPECT_EQ(cu.live_imports(), nranks - 1);
      uint64_t ipc_bytes = 0;
      BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &ipc_bytes));
      EXPECT_GT(ipc_bytes, uint64_t{40000} * sizeof(int32_t));
      cu.stream_destroy(s);
    });
  }
}

// A seeded random run of the eight collectives back to back on one stream:
// counts across chunk boundaries, random roots, out of place or in each
// canonical in-place layout; every result exact. The draws are the same on
// every rank.
TEST(CudaIpc, ARandomSequenceOfCollectivesStaysExact) {
  for (int nranks : {3, 4}) {
    SCOPED_TRACE(std::to_string(nranks) + " ranks");
    run_ranks(nranks, ipc_env(), [](braid_comm_t comm, int rank, int n) {
      const FakeCuda& cu = fake_cuda();
      void* s = cu.stream_create();
      std::mt19937_64 rng(20261202);
      const char* names[] = {"all_reduce",     "broadcast", "reduce",  "all_gather",
                             "reduce_scatter", "gather",    "scatter", "all_to_all"};
      for (int k = 0; k < 96; ++k) {
        const int kind = static_cast<int>(rng() % 8), root = static_cast<int>(rng() % n);
        const size_t c = 1 + rng() % 24000;
        const bool in_place = rng() % 2 == 0;
        SCOPED_TRACE(std::string(names[kind]) + " #" + std::to_string(k) + ", count " + std::to_string(c) +
                     (in_place ? ", in place" : "") + ", root " + std::to_string(root));
        // Element i of rank p's input (c * n of them).
        auto v = [k](int p, size_t i) { return static_cast<int32_t>((p + 1) * 7919 + k * 131 + (i % 1009)); };
        const size_t big = c * static_cast<size_t>(n);
        Buffer<int32_t> in(true, big, 0), out(true, big, -1);
        for (size_t i = 0; i < big; ++i) in[i] = v(rank, i);
        const int32_t* send = in.data();
        int32_t* recv = out.data();
        if (in_place) {
          // The layouts braid reads as in place; elsewhere, the input where
          // the output is.
          for (size_t i = 0; i < big; ++i) out[i] = v(rank, i);
          send = recv;
          if (kind == 3 || kind == 5) send = recv + rank * c;           // all_gather, gather: own block
          if (kind == 4) recv = out.data() + rank * c;                  // reduce_scatter: own block
          if (kind == 6 && rank == root) recv = out.data() + root * c;  // scatter at the root
        }
        braid_result_t rc = BRAID_SUCCESS;
        switch (kind) {
          case 0:
            rc = braid_all_reduce(send, recv, c, BRAID_INT32, BRAID_SUM, comm, s);
            break;
          case 1:
            rc = braid_broadcast(send, recv, c, BRAID_INT32, root, comm, s);
            break;
          case 2:
            rc = braid_reduce(send, recv, c, BRAID_INT32, BRAID_MAX, root, comm, s);
            break;
          case 3:
            rc = braid_all_gather(send, recv, c, BRAID_INT32, comm, s);
            break;
          case 4:
            rc = braid_reduce_scatter(send, recv, c, BRAID_INT32, BRAID_SUM, comm, s);
            break;
          case 5:
            rc = braid_gather(send, recv, c, BRAID_INT32, root, comm, s);
            break;
          case 6:
            rc = braid_scatter(send, recv, c, BRAID_INT32, root, comm, s);
            break;
          default:
            rc = braid_all_to_all(send, recv, c, BRAID_INT32, comm, s);
            break;
        }
        BRAID_ASSERT_OK(rc);
        cu.stream_synchronize(s);
        const int32_t* got = recv;
        for (size_t i = 0; i < c; ++i) {
          int32_t sum = 0, mx = INT32_MIN, rsum = 0;
          for (int p = 0; p < n; ++p) {
            sum += v(p, i);
            mx = std::max(mx, v(p, i));
            rsum += v(p, rank * c + i);
          }
          switch (kind) {
            case 0:
              ASSERT_EQ(got[i], sum) << i;
              break;
            case 1:
              ASSERT_EQ(got[i], v(root, i)) << i;
              break;
            case 2:
              if (rank == root) {
                ASSERT_EQ(got[i], mx) << i;
              }
              break;
            case 4:
              ASSERT_EQ(got[i], rsum) << i;
              break;
            case 6:
              ASSERT_EQ(got[i], v(root, rank * c + i)) << i;
              break;
            default:
              for (int p = 0; p < n; ++p) {
                // In place, a gather's input is the rank's own block of the buffer.
                const size_t at = kind == 7 ? rank * c + i : in_place ? p * c + i : i;
                const int32_t want = v(p, at);
                if (kind != 5 || rank == root) {
                  ASSERT_EQ(got[p * c + i], want) << "block " << p << " at " << i;
                }
              }
          }
        }
      }
      EXPECT_EQ(cu.live_imports(), n - 1);
      cu.stream_destroy(s);
    });
  }
}

// Uneven blocks, some longer than a chunk's piece and some empty, with
// gaps between them that stay untouched; then in place.
TEST(CudaIpc, AllToAllvWithUnevenBlocksAcrossChunks) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t un = static_cast<size_t>(n);
    // Elements rank p sends rank q (a 64 KiB region holds pieces of 5461
    // int32 per rank on 3 ranks): up to three chunks, and p == q == 1 none.
    auto count = [](int p, int q) {
      return p == 1 && q == 1 ? size_t{0} : size_t{4000} * ((p + 2 * q) % 4) + 7;
    };
    auto v = [](int p, int q, size_t i) { return static_cast<int32_t>(p * 1000000 + q * 100000 + i); };
    std::vector<size_t> sc(un), sd(un), rc(un), rd(un);
    size_t in_len = 0, out_len = 0;
    for (int q = 0; q < n; ++q) {
      sc[q] = count(rank, q), sd[q] = in_len, in_len += sc[q] + 3;  // 3 elements apart
      rc[q] = count(q, rank), rd[q] = out_len, out_len += rc[q] + 5;
    }
    Buffer<int32_t> in(true, in_len, 0), out(true, out_len, -1);
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < sc[q]; ++i) in[sd[q] + i] = v(rank, q, i);
    // An empty block's displacement may point anywhere: nothing is read or
    // written there, and the buffers' extents leave it out.
    std::vector<size_t> sd_far = sd, rd_far = rd;
    if (rank == 1) sd_far[1] = rd_far[1] = size_t{1} << 40;
    uint64_t before = 0, after = 0;
    BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &before));
    BRAID_ASSERT_OK(braid_all_to_allv(in.data(), sc.data(), sd_far.data(), out.data(), rc.data(),
                                      rd_far.data(), BRAID_INT32, comm, s));
    cu.stream_synchronize(s);
    BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &after));
    size_t from_peers = 0;
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < rc[p]; ++i)
        ASSERT_EQ(out[rd[p] + i], v(p, rank, i)) << "from " << p << " at " << i;
      for (size_t i = rd[p] + rc[p]; i < rd[p] + rc[p] + 5; ++i) ASSERT_EQ(out[i], -1) << "gap after " << p;
      if (p != rank) from_peers += rc[p] * sizeof(int32_t);
    }
    EXPECT_GE(after - before, from_peers);
    // In place: one buffer, block q's slot (as long as the longer of the
    // blocks to and from q) first sent to q, then received from q.
    std::vector<size_t> slot(un);
    size_t at = 0;
    for (int q = 0; q < n; ++q) slot[q] = at, at += std::max(sc[q], rc[q]) + 3;
    Buffer<int32_t> one(true, at, -1);
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < sc[q]; ++i) one[slot[q] + i] = v(rank, q, i);
    BRAID_ASSERT_OK(braid_all_to_allv(one.data(), sc.data(), slot.data(), one.data(), rc.data(), slot.data(),
                                      BRAID_INT32, comm, s));
    cu.stream_synchronize(s);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < rc[p]; ++i) ASSERT_EQ(one[slot[p] + i], v(p, rank, i)) << "in place, from " << p;
    // One buffer, the blocks received 9000 elements after where the blocks
    // sent start: a chunk's output lands on input a later chunk sends, so
    // the input must be copied aside first.
    const size_t shift = 9000;
    std::vector<size_t> rd_shifted(un);
    for (int q = 0; q < n; ++q) rd_shifted[q] = rd[q] + shift;
    Buffer<int32_t> over(true, std::max(in_len, out_len + shift), -1);
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < sc[q]; ++i) over[sd[q] + i] = v(rank, q, i);
    BRAID_ASSERT_OK(braid_all_to_allv(over.data(), sc.data(), sd.data(), over.data(), rc.data(),
                                      rd_shifted.data(), BRAID_INT32, comm, s));
    cu.stream_synchronize(s);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < rc[p]; ++i)
        ASSERT_EQ(over[rd_shifted[p] + i], v(p, rank, i)) << "overlapping, from " << p << " at " << i;
    cu.stream_destroy(s);
  });
}

// A rank that expects another count from a peer than the peer sends fails
// with BRAID_ERR_MISMATCH before any data moves; the others fail too, and
// nobody hangs.
TEST(CudaIpc, AllToAllvWithCountsThatDisagreeIsAMismatch) {
  auto result = launch(3, ipc_env({{"BRAID_TIMEOUT", "20"}}), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t un = static_cast<size_t>(n);
    std::vector<size_t> sc(un, 100), disp(un), rc(un, 100);
    for (size_t q = 0; q < un; ++q) disp[q] = q * 200;
    if (rank == 2) rc[1] = 150;  // rank 1 sends it 100: the first exchange finds it
    Buffer<int32_t> in(true, 200 * un, 1), out(true, 200 * un, -1);
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_iall_to_allv(in.data(), sc.data(), disp.data(), out.data(), rc.data(), disp.data(),
                                       BRAID_INT32, comm, s, &req));
    const braid_result_t code = braid_wait(&req);
    EXPECT_NE(code, BRAID_SUCCESS);
    if (rank == 2) {
      EXPECT_EQ(code, BRAID_ERR_MISMATCH);
      const std::string m = braid_get_last_error();
      EXPECT_NE(m.find("rank 1 sends 100 elements to rank 2, whose recvcounts[1] is 150"), std::string::npos)
          << m;
    }
    cu.stream_synchronize(s);  // the failed op released the stream
    if (rank == 2) {
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], -1) << "rank 2 moved data at " << i;
    }
    cu.stream_destroy(s);
  });
  ASSERT_TRUE(result.ok()) << result.describe();
}

// BRAID_CHECK_CALLS=1 compares every call before it runs: the IPC path's
// calls pass it, and results stay exact.
TEST(CudaIpc, CheckedCallsStayExact) {
  run_ranks(3, ipc_env({{"BRAID_CHECK_CALLS", "1"}}), [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    run_every_collective(comm, rank, nranks, s);
    EXPECT_EQ(cu.live_imports(), nranks - 1);
    cu.stream_destroy(s);
  });
}

TEST(CudaIpc, FloatingTypesAndAverage) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t c = 30001;  // several chunks of float64
    Buffer<double> d(true, c, 0.0);
    Buffer<float> f(true, c, 0.0f);
    Buffer<uint16_t> b(true, c, 0);  // bfloat16
    for (size_t i = 0; i < c; ++i) {
      d[i] = (rank + 1) * 0.5 + static_cast<double>(i);
      f[i] = static_cast<float>((rank + 1) * (i % 7));
      b[i] = 0x3f80;  // 1.0
    }
    BRAID_ASSERT_OK(braid_all_reduce(d.data(), d.data(), c, BRAID_FLOAT64, BRAID_AVG, comm, s));
    BRAID_ASSERT_OK(braid_all_reduce(f.data(), f.data(), c, BRAID_FLOAT32, BRAID_MIN, comm, s));
    BRAID_ASSERT_OK(braid_all_reduce(b.data(), b.data(), c, BRAID_BFLOAT16, BRAID_SUM, comm, s));
    // float16 12000 * (rank + 1): the sum passes 65504, the average, 24000,
    // fits (each input is divided first, braid.h), in all three reductions.
    const uint16_t half_of[3] = {0x71dc, 0x75dc, 0x7865}, half_24000 = 0x75dc;
    Buffer<uint16_t> h(true, c * n, half_of[rank]), hr(true, c, 0), hs(true, c, 0);
    BRAID_ASSERT_OK(braid_reduce(h.data(), hr.data(), c, BRAID_FLOAT16, BRAID_AVG, 1, comm, s));
    BRAID_ASSERT_OK(braid_reduce_scatter(h.data(), hs.data(), c, BRAID_FLOAT16, BRAID_AVG, comm, s));
    BRAID_ASSERT_OK(braid_all_reduce(h.data(), h.data(), c, BRAID_FLOAT16, BRAID_AVG, comm, s));
    cu.stream_synchronize(s);
    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(h[i], half_24000) << "all_reduce " << i;
      ASSERT_EQ(hs[i], half_24000) << "reduce_scatter " << i;
      if (rank == 1) {
        ASSERT_EQ(hr[i], half_24000) << "reduce " << i;
      }
    }
    double mean_offset = 0;
    for (int p = 0; p < n; ++p) mean_offset += (p + 1) * 0.5;
    mean_offset /= n;
    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(d[i], (static_cast<double>(i) * n + mean_offset * n) / n) << i;
      ASSERT_EQ(f[i], static_cast<float>(i % 7)) << i;
      ASSERT_EQ(b[i], 0x4040) << i;  // 3.0
    }
    cu.stream_destroy(s);
  });
}

// Nine ranks: more sources than one kernel takes (8), so slices are folded.
TEST(CudaIpc, MoreRanksThanAKernelTakesSources) {
  run_ranks(
      9, ipc_env({{"FAKE_CUDA_JITTER_US", "0"}}),
      [](braid_comm_t comm, int rank, int n) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        const size_t c = 2000;
        Buffer<int32_t> x(true, c, 0);
        for (size_t i = 0; i < c; ++i) x[i] = val(rank, i);
        BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), c, BRAID_INT32, BRAID_SUM, comm, s));
        Buffer<int32_t> rs(true, 3, -1), in(true, 3 * n, 0);
        for (size_t i = 0; i < 3 * static_cast<size_t>(n); ++i) in[i] = val(rank, i);
        BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), rs.data(), 3, BRAID_INT32, BRAID_SUM, comm, s));
        cu.stream_synchronize(s);
        for (size_t i = 0; i < c; ++i) {
          int32_t sum = 0;
          for (int p = 0; p < n; ++p) sum += val(p, i);
          ASSERT_EQ(x[i], sum) << i;
        }
        for (size_t i = 0; i < 3; ++i) {
          int32_t sum = 0;
          for (int p = 0; p < n; ++p) sum += val(p, rank * 3 + i);
          ASSERT_EQ(rs[i], sum) << i;
        }
        cu.stream_destroy(s);
      },
      300);
}

// A "kernel" on the stream: writes rank-dependent values when the stream
// gets there.
struct Fill {
  Buffer<int32_t>* v;
  int rank;
  static void run(void* p) {
    auto* f = static_cast<Fill*>(p);
    for (size_t i = 0; i < f->v->size(); ++i) (*f->v)[i] = val(f->rank, i);
  }
};

TEST(CudaIpc, TheCallReturnsAtOnceAndKeepsStreamOrder) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    // The first call sets the windows up (blocking, once); later ones only enqueue.
    Buffer<int32_t> warm(true, 1, 1);
    BRAID_ASSERT_OK(braid_all_reduce(warm.data(), warm.data(), 1, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    const size_t c = 50000;
    Buffer<int32_t> in(true, c, -1), out(true, c, -2);
    Fill fill{&in, rank};
    cu.stream_hold(s, 1);
    ASSERT_EQ(cu.launch_host_func(s, &Fill::run, &fill), 0);
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_iall_reduce(in.data(), out.data(), c, BRAID_INT32, BRAID_SUM, comm, s, &req));
    // Returned with the stream held: nothing read, nothing written.
    EXPECT_EQ(in[0], -1);
    EXPECT_EQ(out[0], -2);
    cu.stream_hold(s, 0);
    // braid_wait covers the results (no stream synchronisation).
    BRAID_ASSERT_OK(braid_wait(&req));
    for (size_t i = 0; i < c; ++i) {
      int32_t sum = 0;
      for (int p = 0; p < n; ++p) sum += val(p, i);
      ASSERT_EQ(out[i], sum) << i;
    }
    cu.stream_synchronize(s);
    cu.stream_destroy(s);
  });
}

// An input that overlaps its output other than in place is copied aside first.
TEST(CudaIpc, OverlappingBuffersAreStillExact) {
  run_ranks(2, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t c = 20000;
    Buffer<int32_t> x(true, c + 3, 0);
    for (size_t i = 0; i < c + 3; ++i) x[i] = val(rank, i);
    // recvbuf three elements ahead of sendbuf: writing chunk k overwrites
    // input of chunk k+1 unless the input was copied first.
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data() + 3, c, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    for (size_t i = 0; i < c; ++i) {
      int32_t sum = 0;
      for (int p = 0; p < n; ++p) sum += val(p, i);
      ASSERT_EQ(x[i + 3], sum) << i;
    }
    cu.stream_destroy(s);
  });
}

// Communicators made by split, destroyed in the body: the windows are
// unmapped and freed in step, never while another rank maps them.
TEST(CudaIpc, DestroyUnmapsAndFreesEveryWindow) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    for (int round = 0; round < 2; ++round) {
      braid_comm_t sub = nullptr;
      BRAID_ASSERT_OK(braid_comm_split(comm, 0, rank, &sub));
      Buffer<int32_t> x(true, 100, rank + 1);
      BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, sub, s));
      cu.stream_synchronize(s);
      EXPECT_EQ(x[99], n * (n + 1) / 2);
      EXPECT_EQ(cu.live_allocs(), 1);  // this rank's window
      EXPECT_EQ(cu.live_imports(), n - 1);
      BRAID_ASSERT_OK(braid_comm_destroy(sub));
      expect_windows_given_back();
    }
    cu.stream_destroy(s);
  });
}

// One rank cannot map the others' windows: every rank learns it at the
// first call and every call goes through host staging, exact all the same;
// the windows made are given back.
TEST(CudaIpc, ARankThatCannotMapFallsBackToHostStagingEverywhere) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    if (rank == 2) cu.fail_ipc_open(1);
    void* s = cu.stream_create();
    run_every_collective(comm, rank, n, s, false);
    expect_windows_given_back();
    uint64_t ipc_bytes = 1;
    BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &ipc_bytes));
    EXPECT_EQ(ipc_bytes, 0u);
    cu.stream_destroy(s);
  });
}

// The window of a failed setup is freed off the engine's driver: freeing
// device memory waits for every stream, and here rank 0's first stream
// waits for a receive that the engine ends only once rank 1, after the
// setup, sends. Freed on the thread driving the engine, the fake's
// cuMemFree waits its 5 s out and counts a violation (a real driver would
// wait for ever).
TEST(CudaIpc, AFailedSetupFreesItsWindowWhileAnEarlierReceiveWaits) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    if (rank == 2) cu.fail_ipc_open(1);
    void* first = cu.stream_create();
    void* second = cu.stream_create();
    Buffer<int32_t> msg(true, 1000, rank == 1 ? 7 : 0);
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_recv(msg.data(), msg.size(), BRAID_INT32, 1, comm, first));
    }
    Buffer<int32_t> x(true, 100, rank + 1);
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, second));
    if (rank == 1) {
      BRAID_ASSERT_OK(braid_send(msg.data(), msg.size(), BRAID_INT32, 0, comm, first));
    }
    cu.stream_synchronize(first);
    cu.stream_synchronize(second);
    EXPECT_EQ(x[99], n * (n + 1) / 2);
    if (rank == 0) {
      EXPECT_EQ(msg[999], 7);
    }
    expect_windows_given_back();
    cu.stream_destroy(first);
    cu.stream_destroy(second);
  });
}

// A rank whose GPU the others cannot reach (here: not visible to them, as
// under per-rank CUDA_VISIBLE_DEVICES): no one maps its window, and every
// call goes through host staging.
TEST(CudaIpc, AGpuWithoutPeerAccessFallsBackToHostStaging) {
  run_ranks(3, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    if (rank == 1) cu.set_pci_bus_id("0000:99:00.0");
    void* s = cu.stream_create();
    Buffer<int32_t> x(true, 5000, rank + 1);
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    EXPECT_EQ(x[4999], n * (n + 1) / 2);
    expect_windows_given_back();
    cu.stream_destroy(s);
  });
}

// Ranks on two GPUs read each other's windows only over a path the topology
// accepts (BRAID_TOPO_FILE: tests/data/dgx_2s_8gpu_4nic.xml, where GPU 0 at
// 0000:03:00.0 has 2 NVLinks to GPU 1, 1 to GPU 4 and none to GPU 5, across
// the sockets), or BRAID_CUDA_P2P_LEVEL bounds; the others go through host
// staging, exact all the same.
TEST(CudaIpc, TwoGpusPairUpByTheirTopologyPath) {
  struct Case {
    const char* peer_gpu;
    const char* level;  // "": unset
    bool through_ipc;
  };
  const Case cases[] = {{"0000:83:00.0", "", true},      {"0000:84:00.0", "", false},
                        {"0000:84:00.0", "SYS", true},   {"0000:83:00.0", "NVL", true},
                        {"0000:84:00.0", "NODE", false}, {"0000:04:00.0", "LOC", false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string("peer GPU ") + c.peer_gpu + ", BRAID_CUDA_P2P_LEVEL=" + c.level);
    Env env =
        ipc_env({{"BRAID_TOPO_FILE", std::string(BRAID_SOURCE_DIR) + "/tests/data/dgx_2s_8gpu_4nic.xml"}});
    if (*c.level != '\0') env.push_back({"BRAID_CUDA_P2P_LEVEL", c.level});
    run_ranks(2, env, [&](braid_comm_t comm, int rank, int n) {
      const FakeCuda& cu = fake_cuda();
      const char* mine = rank == 0 ? "0000:03:00.0" : c.peer_gpu;
      cu.set_pci_bus_id(mine);
      cu.set_peer_bus_ids(rank == 0 ? c.peer_gpu : "0000:03:00.0");
      void* s = cu.stream_create();
      Buffer<int32_t> x(true, 5000, rank + 1);
      BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, s));
      cu.stream_synchronize(s);
      EXPECT_EQ(x[4999], n * (n + 1) / 2);
      uint64_t ipc_bytes = 0;
      BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &ipc_bytes));
      if (c.through_ipc) {
        EXPECT_GT(ipc_bytes, 0u);
        EXPECT_EQ(cu.live_imports(), 1);
      } else {
        EXPECT_EQ(ipc_bytes, 0u);
        expect_windows_given_back();
      }
      cu.stream_destroy(s);
    });
  }
}

// A window record that names this pid is this process's only with this
// process's token (pids repeat across PID namespaces), and its address is
// used only in this context: otherwise the window is opened through its
// handle, which CUDA refuses for a process's own memory, or refused.
TEST(CudaIpc, ASamePidIsNotTheSameProcessWithoutItsToken) {
  run_ranks(1, ipc_env(), [](braid_comm_t, int, int) {
    const FakeCuda& fake = fake_cuda();
    void* s = fake.stream_create();
    const CudaDriver* cu = nullptr;
    ASSERT_TRUE(cuda_driver(&cu).is_ok());
    CUcontext ctx = nullptr;
    ASSERT_EQ(cu->stream_get_ctx(s, &ctx), 0);
    std::atomic<uint64_t> moved{0};
    std::unique_ptr<IpcWindow> w;
    Status made = IpcWindow::make(
        *cu, ctx, 64 * 1024, 2, 0, [] {}, &moved, &w);
    ASSERT_TRUE(made.is_ok()) << made.message();
    const IpcWindowRecord mine = w->record();
    IpcWindowRecord other_namespace = mine;
    other_namespace.process_token ^= 1;
    other_namespace.base = 0x1000;  // not to be used
    Status st = w->map_peer(1, other_namespace, nullptr);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("cuIpcOpenMemHandle"), std::string::npos) << st.message();
    IpcWindowRecord other_context = mine;
    other_context.context ^= 0x10;
    st = w->map_peer(1, other_context, nullptr);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("another CUDA context"), std::string::npos) << st.message();
    EXPECT_TRUE(w->map_peer(1, mine, nullptr).is_ok());  // a rank-thread of this process, as below
    EXPECT_EQ(w->input(1), w->input(0));
    w->unmap_peers();
    w->peers_unmapped();
    w.reset();
    expect_windows_given_back();
    fake.stream_destroy(s);
  });
}

// The legacy default stream, whose handle is NULL to the runtime, goes in
// as CU_STREAM_LEGACY (what the torch backend passes for torch's default
// stream). The kernels were loaded before the first one ran.
TEST(CudaIpc, TheLegacyDefaultStreamWorks) {
  run_ranks(2, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* legacy = reinterpret_cast<void*>(0x1);
    Buffer<int32_t> x(true, 30000, rank + 1);
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, legacy));
    cu.stream_synchronize(legacy);
    EXPECT_EQ(x[29999], n * (n + 1) / 2);
    EXPECT_EQ(cu.live_imports(), n - 1);
    void* kernels = dlopen(BRAID_FAKE_CUDA_KERNELS, RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(kernels, nullptr);
    auto preloads = reinterpret_cast<int (*)()>(dlsym(kernels, "fake_cuda_kernel_preloads"));
    ASSERT_NE(preloads, nullptr);
    EXPECT_EQ(preloads(), 1);
    dlclose(kernels);
  });
}

// Ranks that are threads of one process (as with ncclCommInitAll): CUDA
// refuses to open a process's own IPC handle, so each uses the other's
// window at its address; the collectives still go through the windows, and
// destroy gives them back.
TEST(CudaIpc, RanksThatAreThreadsOfOneProcessShareWindows) {
#if defined(__SANITIZE_THREAD__)
  // Ranks of one process map each shared-memory segment twice, at two
  // addresses: ThreadSanitizer cannot see the order the segments' atomics
  // give the window's bytes, and reports races that are not there.
  GTEST_SKIP()
      << "ranks as threads synchronise through two mappings of one segment, which TSan cannot follow";
#endif
  run_ranks(1, ipc_env(), [](braid_comm_t, int, int) {
    const FakeCuda& cu = fake_cuda();
    braid_unique_id_t id;
    BRAID_ASSERT_OK(braid_get_unique_id(&id));
    constexpr int kRanks = 2;
    std::vector<std::string> failures(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        auto fail = [&](const std::string& what) { failures[r] = what + ": " + braid_get_last_error(); };
        braid_comm_t comm = nullptr;
        if (braid_comm_init_rank(&comm, kRanks, id, r) != BRAID_SUCCESS) return fail("init");
        void* s = cu.stream_create();
        Buffer<int32_t> x(true, 40000, r + 1);  // several 64 KiB chunks
        if (braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, s) != BRAID_SUCCESS)
          return fail("all_reduce");
        cu.stream_synchronize(s);
        for (size_t i = 0; i < x.size(); ++i)
          if (x[i] != 3) return fail("element " + std::to_string(i) + " is " + std::to_string(x[i]));
        uint64_t ipc_bytes = 0;
        if (braid_comm_transport_bytes(comm, "cuda_ipc", &ipc_bytes) != BRAID_SUCCESS || ipc_bytes == 0)
          return fail("no bytes went through the windows");
        if (braid_comm_destroy(comm) != BRAID_SUCCESS) return fail("destroy");
        cu.stream_destroy(s);
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
    expect_windows_given_back();
  });
}

// Device memory of another context on the window's GPU (a library that made
// its own context) is not mapped in the window's: such calls go through
// host staging, exact all the same.
TEST(CudaIpc, BuffersOfAnotherContextGoThroughHostStaging) {
  run_ranks(2, ipc_env(), [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    Buffer<int32_t> warm(true, 1000, 1);  // sets the windows up
    BRAID_ASSERT_OK(braid_all_reduce(warm.data(), warm.data(), warm.size(), BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    uint64_t before = 0, after = 0;
    BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &before));
    EXPECT_GT(before, 0u);
    auto* x = static_cast<int32_t*>(cu.malloc_in_other_context(1000 * sizeof(int32_t)));
    std::fill(x, x + 1000, rank + 1);
    BRAID_ASSERT_OK(braid_all_reduce(x, x, 1000, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    EXPECT_EQ(x[999], n * (n + 1) / 2);
    BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "cuda_ipc", &after));
    EXPECT_EQ(after, before);
    cu.free(x);
    cu.stream_destroy(s);
  });
}

// So does a job whose kernel library is missing.
TEST(CudaIpc, NoKernelLibraryMeansHostStaging) {
  run_ranks(
      2, ipc_env({{"BRAID_CUDA_KERNELS", "/nonexistent/libbraid_cuda.so.0"}}),
      [](braid_comm_t comm, int rank, int n) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<int32_t> x(true, 1000, rank + 1);
        BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, s));
        cu.stream_synchronize(s);
        EXPECT_EQ(x[999], n * (n + 1) / 2);
        EXPECT_EQ(cu.live_imports(), 0);
        EXPECT_EQ(cu.live_allocs(), 0);
        cu.stream_destroy(s);
      });
}

// Ranks that disagree on the path (host memory on one, device memory on
// the other) fail with a mismatch that says so, instead of exchanging data
// that does not line up.
TEST(CudaIpc, HostMemoryOnOneRankAndDeviceMemoryOnAnotherIsAMismatch) {
  auto result = launch(2, ipc_env({{"BRAID_TIMEOUT", "20"}}), [](braid_comm_t comm, int rank, int) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    Buffer<int32_t> warm(true, 1, 1);
    BRAID_ASSERT_OK(braid_all_reduce(warm.data(), warm.data(), 1, BRAID_INT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    Buffer<int32_t> x(rank == 0, 1000, 1);
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, comm, s, &req));
    EXPECT_EQ(braid_wait(&req), BRAID_ERR_MISMATCH);
    const std::string m = braid_get_last_error();
    EXPECT_NE(m.find("device memory through CUDA IPC"), std::string::npos) << m;
    cu.stream_synchronize(s);  // the failed op released the stream
    cu.stream_destroy(s);
  });
  ASSERT_TRUE(result.ok()) << result.describe();
}

// A communicator of the test's own (the launcher destroys `comm`) whose
// windows a first all_reduce of x set up; null if that failed.
braid_comm_t connected_split(braid_comm_t comm, int rank, void* s, Buffer<int32_t>& x) {
  braid_comm_t sub = nullptr;
  if (braid_comm_split(comm, 0, rank, &sub) != BRAID_SUCCESS ||
      braid_all_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, sub, s) != BRAID_SUCCESS) {
    ADD_FAILURE() << braid_get_last_error();
    return nullptr;
  }
  fake_cuda().stream_synchronize(s);
  EXPECT_EQ(fake_cuda().live_imports(), 1);  // the other rank's window
  return sub;
}

// An abort while an op over the window is in flight (its stream not there
// yet): the op fails, its stream is released, and the window goes only
// once the op is settled (the abort's teardown waits for it).
TEST(CudaIpc, AbortWithAnOpInFlight) {
  // The timeout bounds how long destroy waits for the held stream's flags
  // (kept, with a warning).
  auto result = launch(
      2, ipc_env({{"BRAID_TIMEOUT", "2"}}),
      [](braid_comm_t comm, int rank, int) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<int32_t> x(true, 30000, 1);
        braid_comm_t sub = connected_split(comm, rank, s, x);
        ASSERT_NE(sub, nullptr);
        cu.stream_hold(s, 1);
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, sub, s, &req));
        if (rank == 0) {
          BRAID_ASSERT_OK(braid_comm_abort(sub));
          EXPECT_EQ(braid_wait(&req), BRAID_ERR_ABORTED);
        } else {
          EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);  // the peer aborted
          BRAID_EXPECT_OK(braid_comm_destroy(sub));
        }
        cu.stream_hold(s, 0);
        cu.stream_synchronize(s);  // released by the failed op
        EXPECT_EQ(cu.live_imports(), 0);
        EXPECT_EQ(cu.violations(), 0);
        cu.stream_destroy(s);
      },
      60);
  ASSERT_TRUE(result.ok()) << result.describe();
}

// A peer that dies after the setup: the op fails naming it, the stream is
// released, destroy returns, and this rank's window is kept (the dead peer
// may still map it) rather than freed under it.
TEST(CudaIpc, ADeadPeerFailsTheOpAndReleasesTheStream) {
  auto result = launch(
      2, ipc_env({{"BRAID_TIMEOUT", "5"}}),
      [](braid_comm_t comm, int rank, int) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<int32_t> x(true, 30000, 1);
        braid_comm_t sub = connected_split(comm, rank, s, x);
        ASSERT_NE(sub, nullptr);
        if (rank == 1) _exit(0);
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_INT32, BRAID_SUM, sub, s, &req));
        EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);
        const std::string m = braid_get_last_error();
        EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
        cu.stream_synchronize(s);
        BRAID_EXPECT_OK(braid_comm_destroy(sub));
        EXPECT_EQ(cu.live_imports(), 0);
        EXPECT_EQ(cu.violations(), 0);
        cu.stream_destroy(s);
      },
      60);
  ASSERT_TRUE(result.ok()) << result.describe();
}

}  // namespace
}  // namespace braid::test
