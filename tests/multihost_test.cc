// Several hosts simulated on one machine (BRAID_HOST_ID per rank, loopback
// TCP between hosts): every algorithm gives exact results on every shape,
// shm carries the traffic inside a host and TCP only what must cross, and
// the hierarchical schedule sends less over the network than a flat ring.
#include <braid/braid.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tests/rank_test.h"

namespace braid::test {
namespace {

// Ranks in blocks: rank r of n on host r * hosts / n.
std::function<void(int)> block_hosts(int nranks, int hosts) {
  return [=](int rank) {
    setenv("BRAID_HOST_ID", ("host-" + std::to_string(rank * hosts / nranks)).c_str(), 1);
  };
}

void run_on_hosts(int nranks, std::function<void(int)> placement, const Env& env, const Body& body) {
  auto result = launch(nranks, env, body, 180, true, std::move(placement));
  ASSERT_TRUE(result.ok()) << result.describe();
}

// all_gather and reduce_scatter: blocks in rank order, whatever order the
// schedule visits ranks in; in place too.
void check_gather_scatter(braid_comm_t comm, int rank, int nranks, const std::string& what) {
  const int32_t ranks_sum = nranks * (nranks + 1) / 2;
  for (size_t count : {size_t{1}, size_t{1000}, size_t{70001}}) {
    const size_t n = static_cast<size_t>(nranks);
    std::vector<int32_t> mine(count), all(count * n, -1);
    for (size_t i = 0; i < count; ++i) mine[i] = rank * 100000 + static_cast<int32_t>(i % 977);
    BRAID_ASSERT_OK(braid_all_gather(mine.data(), all.data(), count, BRAID_INT32, comm, nullptr));
    for (size_t r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(all[r * count + i], static_cast<int32_t>(r) * 100000 + static_cast<int32_t>(i % 977))
            << what << " all_gather count " << count << " block " << r;
    std::fill(all.begin(), all.end(), -1);
    std::copy(mine.begin(), mine.end(), all.begin() + static_cast<long>(rank * count));
    BRAID_ASSERT_OK(
        braid_all_gather(all.data() + rank * count, all.data(), count, BRAID_INT32, comm, nullptr));
    for (size_t r = 0; r < n; ++r)
      ASSERT_EQ(all[r * count + count - 1],
                static_cast<int32_t>(r) * 100000 + static_cast<int32_t>((count - 1) % 977))
          << what << " all_gather in place";
    std::vector<int32_t> in(count * n), out(count, -1);
    for (size_t r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i)
        in[r * count + i] = (rank + 1) * static_cast<int32_t>(r * 7 + i % 31);
    BRAID_ASSERT_OK(
        braid_reduce_scatter(in.data(), out.data(), count, BRAID_INT32, BRAID_SUM, comm, nullptr));
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(out[i], ranks_sum * static_cast<int32_t>(rank * 7 + i % 31))
          << what << " reduce_scatter count " << count << " i " << i;
    BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), in.data() + rank * count, count, BRAID_INT32, BRAID_MAX,
                                         comm, nullptr));
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(in[rank * count + i], nranks * static_cast<int32_t>(rank * 7 + i % 31))
          << what << " reduce_scatter in place";
  }
}

// all_reduce, broadcast and reduce with exact integer results (every root),
// sizes that do and do not divide among a host's ranks, in and out of place;
// then all_gather and reduce_scatter.
void check_collectives(braid_comm_t comm, int rank, int nranks, const std::string& what) {
  check_gather_scatter(comm, rank, nranks, what);
  for (size_t count : {size_t{1}, size_t{3}, size_t{1000}, size_t{65537}, size_t{300001}}) {
    std::vector<int32_t> in(count), out(count, -1);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<int32_t>((rank + 1) * (i % 1013));
    const int32_t ranks_sum = nranks * (nranks + 1) / 2;
    BRAID_ASSERT_OK(braid_all_reduce(in.data(), out.data(), count, BRAID_INT32, BRAID_SUM, comm, nullptr));
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(out[i], ranks_sum * static_cast<int32_t>(i % 1013))
          << what << " count " << count << " i " << i;
    BRAID_ASSERT_OK(braid_all_reduce(in.data(), in.data(), count, BRAID_INT32, BRAID_MAX, comm, nullptr));
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(in[i], nranks * static_cast<int32_t>(i % 1013)) << what << " in place, count " << count;
    std::vector<float> f(count, 0.25f * static_cast<float>(rank));
    BRAID_ASSERT_OK(braid_all_reduce(f.data(), f.data(), count, BRAID_FLOAT32, BRAID_AVG, comm, nullptr));
    for (float v : f) ASSERT_EQ(v, 0.125f * static_cast<float>(nranks - 1)) << what << " avg";
    for (int root = 0; root < nranks; ++root) {
      std::vector<int32_t> buf(count, rank == root ? 7 * root + 1 : -1);
      BRAID_ASSERT_OK(braid_broadcast(buf.data(), buf.data(), count, BRAID_INT32, root, comm, nullptr));
      for (int32_t v : buf) ASSERT_EQ(v, 7 * root + 1) << what << " broadcast root " << root;
      std::vector<int32_t> one(count, rank + 1), sum(count, -1);
      BRAID_ASSERT_OK(
          braid_reduce(one.data(), sum.data(), count, BRAID_INT32, BRAID_SUM, root, comm, nullptr));
      if (rank == root) {
        for (int32_t v : sum) ASSERT_EQ(v, ranks_sum) << what << " reduce root " << root;
      }
    }
  }
}

TEST(MultiHost, EveryAlgorithmExactOnEveryShape) {
  struct Shape {
    int nranks, hosts;
  };
  for (Shape s : {Shape{4, 2}, Shape{6, 3}, Shape{5, 2}}) {
    for (const char* algo : {"auto", "ring", "tree", "dbtree", "rd", "rabenseifner", "hier", "direct"}) {
      const std::string what =
          std::to_string(s.nranks) + " ranks on " + std::to_string(s.hosts) + " hosts, BRAID_ALGO=" + algo;
      SCOPED_TRACE(what);
      run_on_hosts(
          s.nranks, block_hosts(s.nranks, s.hosts), {{"BRAID_ALGO", algo}},
          [what](braid_comm_t comm, int rank, int nranks) { check_collectives(comm, rank, nranks, what); });
    }
  }
}

TEST(MultiHost, InterleavedHostsStillExact) {
  // The launcher deals ranks to hosts round-robin: rings and trees are built
  // in host order, so results must not depend on the rank order.
  run_on_hosts(
      6, [](int rank) { setenv("BRAID_HOST_ID", rank % 2 ? "odd" : "even", 1); }, {},
      [](braid_comm_t comm, int rank, int nranks) { check_collectives(comm, rank, nranks, "interleaved"); });
}

uint64_t moved(braid_comm_t comm, const char* transport) {
  uint64_t b = 0;
  EXPECT_EQ(braid_comm_transport_bytes(comm, transport, &b), BRAID_SUCCESS) << braid_get_last_error();
  return b;
}

TEST(MultiHost, ShmInsideAHostTcpAcross) {
  // 2 hosts x 2 ranks, 1 MiB all_reduce: the hierarchical schedule sends
  // each rank's half-block once each way over TCP; a flat ring in host
  // order crosses hosts on half its hops.
  static constexpr size_t kCount = 256 * 1024, kBytes = kCount * 4;
  for (const char* algo : {"hier", "ring"}) {
    run_on_hosts(
        4, block_hosts(4, 2), {{"BRAID_ALGO", algo}}, [algo](braid_comm_t comm, int rank, int nranks) {
          std::vector<float> buf(kCount, 1.0f);
          const uint64_t shm0 = moved(comm, "shm"), tcp0 = moved(comm, "tcp");
          BRAID_ASSERT_OK(
              braid_all_reduce(buf.data(), buf.data(), kCount, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
          for (float v : buf) ASSERT_EQ(v, static_cast<float>(nranks));
          const uint64_t shm = moved(comm, "shm") - shm0, tcp = moved(comm, "tcp") - tcp0;
          if (std::string(algo) == "hier") {
            // Inside the host: half the buffer in the reduce-scatter, half in
            // the all-gather (read from the peer or sent, over shm either way),
            // plus a few bytes of buffer addresses when reading.
            EXPECT_GE(shm, kBytes) << "rank " << rank;
            EXPECT_LT(shm, kBytes + 1024) << "rank " << rank;
            // Across: a 2-rank ring all_reduce of this rank's half-buffer block
            // sends half of the block twice.
            EXPECT_EQ(tcp, kBytes / 2) << "rank " << rank;
          } else {
            // The ring 0-1-2-3-0: ranks 1 and 3 send over TCP, 0 and 2 over shm,
            // each 2 (n-1)/n of the buffer.
            const uint64_t ring_bytes = kBytes / 4 * 6;
            EXPECT_EQ(rank % 2 == 1 ? tcp : shm, ring_bytes) << "rank " << rank;
            EXPECT_EQ(rank % 2 == 1 ? shm : tcp, 0u) << "rank " << rank;
          }
        });
  }
}

TEST(MultiHost, TransportBytesRejectsUnknownTransport) {
  run_ranks(2, {}, [](braid_comm_t comm, int, int) {
    uint64_t b = 0;
    EXPECT_EQ(braid_comm_transport_bytes(comm, "ib", &b), BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(braid_get_last_error()).find("'ib' is not one of shm, tcp, self"),
              std::string::npos)
        << braid_get_last_error();
    EXPECT_EQ(braid_comm_transport_bytes(comm, "shm", nullptr), BRAID_ERR_INVALID_ARGUMENT);
  });
}

TEST(MultiHost, BadAlgoSpecIsRefusedNamingTheVariable) {
  // The settings are read before anything is set up: the first call fails.
  setenv("BRAID_ALGO", "all_gather:tree", 1);
  braid_unique_id_t id;
  EXPECT_EQ(braid_get_unique_id(&id), BRAID_ERR_INVALID_ARGUMENT);
  EXPECT_NE(
      std::string(braid_get_last_error()).find("BRAID_ALGO='all_gather:tree': all_gather has no algorithm"),
      std::string::npos)
      << braid_get_last_error();
  unsetenv("BRAID_ALGO");
}

}  // namespace
}  // namespace braid::test
