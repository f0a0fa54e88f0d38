// Stream-ordered operations (transports/cuda/stream_staging.h) across real
// forked ranks, through a fake CUDA driver (tests/fake_libcuda.cc) whose
// streams are threads running their queue in order. What is checked is
// braid's side of the contract: the call returns before its stream runs, the
// op reads what earlier stream work wrote, results land in order on the
// stream, i-requests wait for the stream, groups on one stream do not
// deadlock, and a dead peer leaves no stream waiting forever.
#include <braid/braid.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/fake_cuda.h"
#include "tests/rank_test.h"

namespace braid::test {
namespace {

// These tests are about host staging: the one-host communicators they make
// would otherwise try CUDA IPC first (tests/cuda_ipc_test.cc covers that).
const int kHostStagingOnly = setenv("BRAID_CUDA_IPC", "0", 1);

// A "kernel" on the stream: fills v with rank-dependent values when the
// stream gets there.
struct Fill {
  Buffer<float>* v;
  int rank;
  static void run(void* p) {
    auto* f = static_cast<Fill*>(p);
    for (size_t i = 0; i < f->v->size(); ++i) (*f->v)[i] = static_cast<float>((f->rank + 1) * (i % 13 + 1));
  }
};

float sum_of(size_t i, int nranks) {
  return static_cast<float>(nranks * (nranks + 1) / 2 * (i % 13 + 1));
}

TEST(StreamOrdered, AllReduceRunsWhenTheStreamGetsThereAndReturnsAtOnce) {
  run_ranks(3, {}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    for (bool device : {true, false})
      for (size_t count : {size_t{1}, size_t{1000}, size_t{300001}}) {
        Buffer<float> in(device, count, -1.0f), out(device, count, -2.0f);
        Fill fill{&in, rank};
        cu.stream_hold(s, 1);
        ASSERT_EQ(cu.launch_host_func(s, &Fill::run, &fill), 0);
        // Returns with the stream held: nothing ran, nothing was touched.
        const int copies = cu.copies();
        BRAID_ASSERT_OK(braid_all_reduce(in.data(), out.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, s));
        // Device buffers go through a staging block (one copy in, one out);
        // host buffers are used in place.
        EXPECT_EQ(cu.copies() - copies, device ? 2 : 0);
        EXPECT_EQ(out[0], -2.0f);
        EXPECT_EQ(in[0], -1.0f);
        cu.stream_hold(s, 0);
        cu.stream_synchronize(s);
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(out[i], sum_of(i, nranks)) << "count " << count << " i " << i;
        // In place, twice in a row on the stream: the second reads the first's result.
        BRAID_ASSERT_OK(braid_all_reduce(out.data(), out.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, s));
        BRAID_ASSERT_OK(braid_all_reduce(out.data(), out.data(), count, BRAID_FLOAT32, BRAID_MAX, comm, s));
        cu.stream_synchronize(s);
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], nranks * sum_of(i, nranks)) << "count " << count;
      }
    // Staging blocks are reused, not pinned per call. Calls in flight
    // together each hold one, and a block comes back once its stream is
    // done and its op has seen that: the op before may still hold one.
    const int pinned = cu.pinned_blocks();
    Buffer<float> x(true, 4096, 1.0f);
    for (int i = 0; i < 20; ++i) {
      BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
      cu.stream_synchronize(s);
    }
    EXPECT_LE(cu.pinned_blocks(), pinned + 1);
    float expect = 1.0f;
    for (int i = 0; i < 20; ++i) expect *= static_cast<float>(nranks);
    EXPECT_EQ(x[4095], expect);
    cu.stream_destroy(s);
  });
}

// One all_reduce on a held stream while another thread (as the fake has
// it) captures a graph in global mode; checks the capture and the sums.
void expect_capture_left_alone(braid_comm_t comm, Buffer<float>& x, void* s, int nranks) {
  const FakeCuda& cu = fake_cuda();
  cu.global_capture(1);
  cu.stream_hold(s, 1);
  BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
  // The engine waits for the held stream meanwhile, querying its event.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  cu.stream_hold(s, 0);
  cu.stream_synchronize(s);
  EXPECT_EQ(cu.capture_invalidated(), 0) << "a braid call ended another thread's graph capture";
  cu.global_capture(0);
  for (size_t i = 0; i < x.size(); i += 9973) ASSERT_EQ(x[i], nranks * (nranks + 1) / 2.0f) << i;
}

// Another thread capturing a CUDA graph in global mode (torch.cuda.graph)
// must not be disturbed by braid's calls: its staging allocation on the
// caller's thread and its event queries while the engine waits for a
// held stream run in relaxed capture mode. In global mode the driver
// fails them and ends the capture (the fake does too).
TEST(StreamOrdered, AGraphCapturedOnAnotherThreadIsLeftAlone) {
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    Buffer<float> x(true, 300001, static_cast<float>(rank + 1));
    // Once with a staging block to pin, once with it reused (so only the
    // event queries are left to meet the capture).
    for (bool pinned_before : {false, true}) {
      if (pinned_before) {
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rank + 1);
      }
      expect_capture_left_alone(comm, x, s, nranks);
    }
    BRAID_ASSERT_OK(braid_barrier(comm, nullptr));
    cu.stream_destroy(s);
  });
}

// An input the algorithm reads through a copy is copied when the stream
// gets there, not at the call: host memory whose input overlaps its output
// other than in place (all_reduce one element over, all_to_all in place),
// and a float16 AVG (its divided copy). The stream's earlier "kernel" writes
// the inputs. Before, the copies were made at the call and held the stale
// values.
TEST(StreamOrdered, InputsCopiedForTheAlgorithmAreReadInStreamOrder) {
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t count = 5000;
    Buffer<float> x(false, count * nranks + 1, -7.0f);
    Fill fill{&x, rank};
    cu.stream_hold(s, 1);
    ASSERT_EQ(cu.launch_host_func(s, &Fill::run, &fill), 0);
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data() + 1, count, BRAID_FLOAT32, BRAID_SUM, comm, s));
    cu.stream_hold(s, 0);
    cu.stream_synchronize(s);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(x[i + 1], sum_of(i, nranks)) << "shifted all_reduce " << i;
    cu.stream_hold(s, 1);
    ASSERT_EQ(cu.launch_host_func(s, &Fill::run, &fill), 0);
    BRAID_ASSERT_OK(braid_all_to_all(x.data(), x.data(), count, BRAID_FLOAT32, comm, s));
    cu.stream_hold(s, 0);
    cu.stream_synchronize(s);
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < count; ++i) {
        const size_t at = static_cast<size_t>(rank) * count + i;  // p's block for this rank
        ASSERT_EQ(x[p * count + i], static_cast<float>((p + 1) * (at % 13 + 1)))
            << "all_to_all " << p << " " << i;
      }
    // float16 AVG: 0x4000 (2.0) written by the stream, -7 (0xC700) before.
    struct Twos {
      Buffer<uint16_t>* h;
      static void run(void* p) {
        auto* t = static_cast<Twos*>(p);
        for (size_t i = 0; i < t->h->size(); ++i) (*t->h)[i] = 0x4000;
      }
    };
    Buffer<uint16_t> h(false, count, 0xC700), avg(false, count, 0);
    Twos twos{&h};
    cu.stream_hold(s, 1);
    ASSERT_EQ(cu.launch_host_func(s, &Twos::run, &twos), 0);
    BRAID_ASSERT_OK(braid_all_reduce(h.data(), avg.data(), count, BRAID_FLOAT16, BRAID_AVG, comm, s));
    cu.stream_hold(s, 0);
    cu.stream_synchronize(s);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(avg[i], 0x4000) << "float16 avg " << i;
    cu.stream_destroy(s);
  });
}

TEST(StreamOrdered, EveryCollectiveGivesExactResults) {
  run_ranks(3, {}, [](braid_comm_t comm, int rank, int n) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t c = 1001;
    auto val = [](int r, size_t i) { return static_cast<int32_t>(r * 100000 + static_cast<int>(i)); };
    // Device buffers, and some host ones (used in place), mixed in one call too.
    Buffer<int32_t> mine(true, c * n, 0), all(true, c * n, -1), reduced(false, c, -1);
    for (size_t i = 0; i < c * n; ++i) mine[i] = val(rank, i);
    // broadcast from rank 1, reduce to rank 2, all_gather, reduce_scatter,
    // gather to 0, scatter from 1, all_to_all: enqueued back to back.
    Buffer<int32_t> bcast(false, c, -1);
    if (rank == 1) std::copy(mine.data(), mine.data() + c, bcast.data());
    BRAID_ASSERT_OK(braid_broadcast(bcast.data(), bcast.data(), c, BRAID_INT32, 1, comm, s));
    BRAID_ASSERT_OK(braid_reduce(mine.data(), reduced.data(), c, BRAID_INT32, BRAID_SUM, 2, comm, s));
    BRAID_ASSERT_OK(braid_all_gather(mine.data(), all.data(), c, BRAID_INT32, comm, s));
    Buffer<int32_t> rs(true, c, -1), gathered(true, c * n, -1), scattered(false, c, -1), a2a(true, c * n, -1);
    BRAID_ASSERT_OK(braid_reduce_scatter(mine.data(), rs.data(), c, BRAID_INT32, BRAID_SUM, comm, s));
    BRAID_ASSERT_OK(braid_gather(mine.data(), gathered.data(), c, BRAID_INT32, 0, comm, s));
    BRAID_ASSERT_OK(braid_scatter(mine.data(), scattered.data(), c, BRAID_INT32, 1, comm, s));
    BRAID_ASSERT_OK(braid_all_to_all(mine.data(), a2a.data(), c, BRAID_INT32, comm, s));
    // all_to_allv: rank r sends p + 1 elements to p; the gaps between the
    // received blocks must keep what the caller had there.
    std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
    for (int p = 0; p < n; ++p) {
      sc[p] = p + 1;
      sd[p] = 10 * p;
      rc[p] = rank + 1;
      rd[p] = 10 * p;
    }
    Buffer<int32_t> v_out(true, 10 * n, -7);
    BRAID_ASSERT_OK(braid_all_to_allv(mine.data(), sc.data(), sd.data(), v_out.data(), rc.data(), rd.data(),
                                      BRAID_INT32, comm, s));
    BRAID_ASSERT_OK(braid_barrier(comm, s));
    // A ring of sends and receives, grouped on the one stream, and a receive from any source.
    Buffer<int32_t> got(true, c, -1), any(true, c, -1);
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    BRAID_ASSERT_OK(braid_group_start());
    BRAID_ASSERT_OK(braid_send(mine.data(), c, BRAID_INT32, next, comm, s));
    BRAID_ASSERT_OK(braid_recv(got.data(), c, BRAID_INT32, prev, comm, s));
    BRAID_ASSERT_OK(braid_group_end());
    int source = -1;
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_recv_any(any.data(), c, BRAID_INT32, &source, comm, s));
    } else if (rank == 2) {
      BRAID_ASSERT_OK(braid_send(mine.data(), c, BRAID_INT32, 0, comm, s));
    }
    cu.stream_synchronize(s);

    for (size_t i = 0; i < c; ++i) {
      ASSERT_EQ(bcast[i], val(1, i));
      if (rank == 2) {
        ASSERT_EQ(reduced[i], val(0, i) + val(1, i) + val(2, i));
      } else {
        ASSERT_EQ(reduced[i], -1);  // not the root: untouched
      }
      ASSERT_EQ(rs[i], val(0, rank * c + i) + val(1, rank * c + i) + val(2, rank * c + i));
      ASSERT_EQ(scattered[i], val(1, rank * c + i));
      ASSERT_EQ(got[i], val(prev, i));
      if (rank == 0) {
        ASSERT_EQ(any[i], val(2, i));
      }
    }
    for (int p = 0; p < n; ++p) {
      for (size_t i = 0; i < c; ++i) {
        ASSERT_EQ(all[p * c + i], val(p, i));
        ASSERT_EQ(gathered[p * c + i], rank == 0 ? val(p, i) : -1);
        ASSERT_EQ(a2a[p * c + i], val(p, rank * c + i));
      }
      for (size_t i = 0; i < 10; ++i) {
        ASSERT_EQ(v_out[10 * p + i], i <= static_cast<size_t>(rank) ? val(p, 10 * rank + i) : -7)
            << "from " << p << " at " << i;
      }
    }
    if (rank == 0) {
      EXPECT_EQ(source, 2);
    }
    cu.stream_destroy(s);
  });
}

TEST(StreamOrdered, WaitOnARequestWaitsForTheStreamsCopyBack) {
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    Buffer<float> in(true, 1 << 18, 0.0f), out(true, 1 << 18, -1.0f);
    Fill fill{&in, rank};
    ASSERT_EQ(cu.launch_host_func(s, &Fill::run, &fill), 0);
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(
        braid_iall_reduce(in.data(), out.data(), in.size(), BRAID_FLOAT32, BRAID_SUM, comm, s, &req));
    BRAID_ASSERT_OK(braid_wait(&req));
    // No stream synchronisation: braid_wait covered the copy back.
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], sum_of(i, nranks));
    cu.stream_synchronize(s);
    cu.stream_destroy(s);
  });
}

TEST(StreamOrdered, LargeExchangeInAGroupOnOneStreamDoesNotDeadlock) {
  // Each rank sends 8 MiB to the other and receives 8 MiB: more than the
  // transports buffer, so each send needs the peer's receive running, which
  // needs the peer's stream past its own send's staging.
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t count = 2 << 20;
    Buffer<int32_t> out(true, count, 0), in(false, count, -1);
    for (size_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(rank * 7 + i);
    const int peer = 1 - rank;
    BRAID_ASSERT_OK(braid_group_start());
    BRAID_ASSERT_OK(braid_send(out.data(), count, BRAID_INT32, peer, comm, s));
    BRAID_ASSERT_OK(braid_recv(in.data(), count, BRAID_INT32, peer, comm, s));
    BRAID_ASSERT_OK(braid_group_end());
    cu.stream_synchronize(s);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], static_cast<int32_t>(peer * 7 + i));
    cu.stream_destroy(s);
  });
}

TEST(StreamOrdered, ADeadPeerIsAnErrorAndLeavesNoStreamWaiting) {
  auto result = launch(
      2, {{"BRAID_TIMEOUT", "3"}},
      [](braid_comm_t comm, int rank, int) {
        if (rank == 1) _exit(0);  // leaves without calling
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<float> x(true, 1000, 1.0f), y(true, 1000, -1.0f);
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), y.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s, &req));
        BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
        EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);
        const std::string m = braid_get_last_error();
        EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
        cu.stream_synchronize(s);  // returns: the failed ops released the stream
        braid_result_t async = BRAID_SUCCESS;
        BRAID_ASSERT_OK(braid_comm_get_async_error(comm, &async));
        EXPECT_NE(async, BRAID_SUCCESS);
        cu.stream_destroy(s);
      },
      60);
  ASSERT_TRUE(result.ok()) << result.describe();
}

// A call that fails on one rank after its arguments passed (its staging
// memory cannot be pinned) breaks the communicator, so the peer's half of
// the call fails at once, naming why; it waited out its 60 s timeout.
TEST(StreamOrdered, ACallThatFailsOnOneRankFailsItsPeersAtOnce) {
  run_ranks(
      2, {{"BRAID_TIMEOUT", "60"}},
      [](braid_comm_t comm, int rank, int) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<float> small(true, 1000, 1.0f);
        BRAID_ASSERT_OK(
            braid_all_reduce(small.data(), small.data(), small.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
        cu.stream_synchronize(s);
        Buffer<float> big(true, size_t{4} << 20, 1.0f);  // needs a larger staging block
        if (rank == 0) cu.fail_host_alloc(1);
        const auto start = std::chrono::steady_clock::now();
        braid_request_t req = nullptr;
        const braid_result_t r =
            braid_iall_reduce(big.data(), big.data(), big.size(), BRAID_FLOAT32, BRAID_SUM, comm, s, &req);
        std::string m;
        if (rank == 0) {
          EXPECT_NE(r, BRAID_SUCCESS);
          m = braid_get_last_error();
          EXPECT_NE(m.find("cuMemHostAlloc"), std::string::npos) << m;
          cu.fail_host_alloc(0);
        } else {
          BRAID_ASSERT_OK(r);
          EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);
          m = braid_get_last_error();
          EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
          EXPECT_NE(m.find("cuMemHostAlloc"), std::string::npos) << m;
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << m;
        }
        cu.stream_synchronize(s);
        cu.stream_destroy(s);
      },
      120);
}

// Managed memory in a stream-ordered call is copied through the staging
// block as device memory is: the host must not touch it while kernels run on
// a device without concurrent managed access. A host-ordered call reads it
// in place (the caller synchronized first).
TEST(StreamOrdered, ManagedMemoryIsStagedLikeDeviceMemory) {
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    const size_t count = 1000;
    auto* in = static_cast<float*>(cu.malloc_managed(count * sizeof(float)));
    auto* out = static_cast<float*>(cu.malloc_managed(count * sizeof(float)));
    std::fill(in, in + count, static_cast<float>(rank + 1));
    std::fill(out, out + count, -2.0f);
    const float sum = static_cast<float>(nranks * (nranks + 1) / 2);
    int copies = cu.copies();
    BRAID_ASSERT_OK(braid_all_reduce(in, out, count, BRAID_FLOAT32, BRAID_SUM, comm, s));
    EXPECT_EQ(cu.copies() - copies, 2);  // in and out through the block
    cu.stream_synchronize(s);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], sum) << i;
    copies = cu.copies();
    BRAID_ASSERT_OK(braid_all_reduce(out, out, count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(cu.copies(), copies);
    EXPECT_EQ(out[count - 1], nranks * sum);
    cu.free_managed(in);
    cu.free_managed(out);
    cu.stream_destroy(s);
  });
}

// A device error (an illegal address in some kernel) stops the context's
// host functions, so the stream never tells braid it reached the call: the
// event braid records behind it reports the error, and the call fails on
// every rank at once, not at its 60 s timeout. Communicators are destroyed
// promptly too (the pool stops waiting for a block the stream will not
// give back).
TEST(StreamOrdered, ADeviceErrorFailsTheCallAtOnceOnEveryRank) {
  run_ranks(
      2, {{"BRAID_TIMEOUT", "60"}},
      [](braid_comm_t comm, int rank, int) {
        const FakeCuda& cu = fake_cuda();
        void* s = cu.stream_create();
        Buffer<float> x(true, 1000, 1.0f);
        BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
        cu.stream_synchronize(s);
        if (rank == 0) cu.stream_hold(s, 1);  // its earlier work still runs
        const auto start = std::chrono::steady_clock::now();
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s, &req));
        if (rank == 0) {
          cu.device_fault(700);  // CUDA_ERROR_ILLEGAL_ADDRESS
          cu.stream_hold(s, 0);
        }
        EXPECT_NE(braid_wait(&req), BRAID_SUCCESS);
        const std::string m = braid_get_last_error();
        EXPECT_NE(m.find("CUDA error 700 (an illegal memory access was encountered)"), std::string::npos)
            << m;
        if (rank != 0) {
          EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << m;
        cu.stream_synchronize(s);
        cu.stream_destroy(s);
      },
      120);
}

// BRAID_CHECK_CALLS=1 with a rank whose stream reaches the call late: its
// peer's call check arrives while the op still waits for the stream, which
// is no mismatch (the check compares once this rank gets there).
TEST(StreamOrdered, CheckedCallsWithAStreamThatComesLate) {
  run_ranks(2, {{"BRAID_CHECK_CALLS", "1"}}, [](braid_comm_t comm, int rank, int nranks) {
    const FakeCuda& cu = fake_cuda();
    void* s = cu.stream_create();
    Buffer<float> x(true, 1000, static_cast<float>(rank + 1));
    if (rank == 0) cu.stream_hold(s, 1);
    BRAID_ASSERT_OK(braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, s));
    if (rank == 0) {
      usleep(200 * 1000);  // the engine looks at the peer's messages every 20 ms meanwhile
      cu.stream_hold(s, 0);
    }
    cu.stream_synchronize(s);
    braid_result_t async = BRAID_SUCCESS;
    BRAID_ASSERT_OK(braid_comm_get_async_error(comm, &async));
    EXPECT_EQ(async, BRAID_SUCCESS) << braid_comm_get_last_error(comm);
    EXPECT_EQ(x[999], static_cast<float>(nranks * (nranks + 1) / 2));
    cu.stream_destroy(s);
  });
}

TEST(StreamOrdered, AStreamThatNeverGetsThereTimesOutAndDestroyReturns) {
  run_ranks(
      2, {{"BRAID_TIMEOUT", "1"}},
      [](braid_comm_t comm, int rank, int) {
        const FakeCuda& cu = fake_cuda();
        braid_comm_t sub = nullptr;
        BRAID_ASSERT_OK(braid_comm_split(comm, 0, rank, &sub));
        void* s = cu.stream_create();
        Buffer<float> x(true, 1000, 1.0f);
        cu.stream_hold(s, 1);  // the stream never reaches the call while braid waits
        braid_request_t req = nullptr;
        BRAID_ASSERT_OK(
            braid_iall_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, sub, s, &req));
        EXPECT_EQ(braid_wait(&req), BRAID_ERR_TIMEOUT);
        const std::string m = braid_get_last_error();
        EXPECT_NE(m.find("waiting for its CUDA stream to reach it"), std::string::npos) << m;
        // Returns although the stream still holds the staging block (kept, with a warning).
        BRAID_EXPECT_OK(braid_comm_destroy(sub));
        cu.stream_hold(s, 0);
        cu.stream_synchronize(s);  // the failed op released it: the stream drains (outputs undefined)
        cu.stream_destroy(s);
      },
      60);
}

TEST(StreamOrdered, BadStreamsAndDeviceBuffersWithoutAStreamAreNamed) {
  run_ranks(1, {}, [](braid_comm_t comm, int, int) {
    const FakeCuda& cu = fake_cuda();
    std::vector<float> dev(64, 1.0f), host(64, 0.0f);
    int not_a_stream = 0;
    EXPECT_EQ(braid_all_reduce(host.data(), host.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, &not_a_stream),
              BRAID_ERR_SYSTEM);
    std::string m = braid_get_last_error();
    EXPECT_NE(m.find("cuStreamGetCtx"), std::string::npos) << m;
    EXPECT_NE(m.find("invalid resource handle"), std::string::npos) << m;
    // Device memory in a host-ordered call: refused, pointing at the stream.
    cu.set_device_range(dev.data(), dev.size() * sizeof(float));
    EXPECT_EQ(braid_all_reduce(dev.data(), dev.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, nullptr),
              BRAID_ERR_UNSUPPORTED);
    m = braid_get_last_error();
    EXPECT_NE(m.find("is memory of CUDA device 3"), std::string::npos) << m;
    EXPECT_NE(m.find("stream"), std::string::npos) << m;
    // The same buffer through a stream works.
    void* s = cu.stream_create();
    BRAID_ASSERT_OK(braid_all_reduce(dev.data(), dev.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    EXPECT_EQ(dev[63], 1.0f);
    // A stream being captured into a CUDA graph: refused, saying so, and
    // nothing enqueued; the call works again once the capture ended.
    cu.stream_capture(s, 1);
    const int copies = cu.copies();
    EXPECT_EQ(braid_all_reduce(dev.data(), dev.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, s),
              BRAID_ERR_UNSUPPORTED);
    m = braid_get_last_error();
    EXPECT_NE(m.find("captured into a CUDA graph"), std::string::npos) << m;
    EXPECT_EQ(cu.copies(), copies);
    cu.stream_capture(s, 0);
    BRAID_ASSERT_OK(braid_all_reduce(dev.data(), dev.data(), 64, BRAID_FLOAT32, BRAID_SUM, comm, s));
    cu.stream_synchronize(s);
    EXPECT_EQ(dev[63], 1.0f);
    cu.stream_destroy(s);
  });
}

}  // namespace
}  // namespace braid::test
