// Collectives and point-to-point across real forked processes over real shm
// and tcp: exact results, groups, requests, splits, several communicators.
// The full dtype x op x root x size matrix lives in check_matrix_test.
#include <braid/braid.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "tests/rank_test.h"

namespace braid::test {
namespace {

class Transports : public ::testing::TestWithParam<std::string> {};

// float16 bits of 12000 * (rank + 1) for ranks 0-2, and of 24000, their
// average: a float16 AVG of these must not overflow (braid.h).
constexpr uint16_t kHalfOf[3] = {0x71dc, 0x75dc, 0x7865};
constexpr uint16_t kHalf24000 = 0x75dc;

std::vector<float> expected_sum(size_t count, int nranks) {
  std::vector<float> e(count);
  for (size_t i = 0; i < count; ++i) {
    float s = 0;
    for (int r = 0; r < nranks; ++r) s += static_cast<float>((r + 1) * static_cast<int>(i % 97));
    e[i] = s;
  }
  return e;
}

TEST_P(Transports, AllReduceSizesAndRankCounts) {
  for (int n : {2, 3, 4}) {
    run_ranks(n, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
      // 5 elements: direct; 300001: several ring rounds with a ragged tail.
      for (size_t count : {size_t{1}, size_t{5}, size_t{4099}, size_t{300001}}) {
        std::vector<float> in(count), out(count, -1);
        for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 97));
        BRAID_ASSERT_OK(
            braid_all_reduce(in.data(), out.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
        EXPECT_EQ(out, expected_sum(count, nranks)) << "count " << count;
        BRAID_ASSERT_OK(
            braid_all_reduce(in.data(), in.data(), count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
        EXPECT_EQ(in, expected_sum(count, nranks)) << "in place, count " << count;
      }
    });
  }
}

TEST_P(Transports, EveryAllReduceAlgorithmAgrees) {
  // peer_read reads peers' buffers with process_vm_readv on shm; over tcp
  // it falls back to the ring. Direct beyond one slot falls back too.
  for (const char* algo : {"ring", "direct", "peer_read", "tree", "dbtree", "rd", "rabenseifner"}) {
    Env env = transport_env(GetParam());
    env.push_back({"BRAID_ALGO", algo});
    run_ranks(3, env, [algo](braid_comm_t comm, int rank, int) {
      for (size_t count : {size_t{1000}, size_t{100003}}) {
        std::vector<int64_t> in(count), out(count);
        for (size_t i = 0; i < count; ++i) in[i] = static_cast<int64_t>(i) * (rank == 1 ? -3 : 2);
        BRAID_ASSERT_OK(
            braid_all_reduce(in.data(), out.data(), count, BRAID_INT64, BRAID_MIN, comm, nullptr));
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(out[i], static_cast<int64_t>(i) * -3) << algo << " " << count;
        BRAID_ASSERT_OK(braid_all_reduce(in.data(), in.data(), count, BRAID_INT64, BRAID_SUM, comm, nullptr));
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(in[i], static_cast<int64_t>(i) * 1) << algo << " in place";
        std::vector<double> f(count, 0.5 + rank);
        BRAID_ASSERT_OK(braid_all_reduce(f.data(), f.data(), count, BRAID_FLOAT64, BRAID_AVG, comm, nullptr));
        for (double v : f) ASSERT_EQ(v, 1.5) << algo << " avg";
        // float16 12000, 24000, 36000: the sum passes 65504, the average
        // (24000) fits, and every input / 3 and partial sum is exact.
        std::vector<uint16_t> h(count, kHalfOf[rank]), hout(count, 0);
        BRAID_ASSERT_OK(
            braid_all_reduce(h.data(), hout.data(), count, BRAID_FLOAT16, BRAID_AVG, comm, nullptr));
        for (uint16_t v : hout) ASSERT_EQ(v, kHalf24000) << algo << " float16 avg";
        BRAID_ASSERT_OK(braid_all_reduce(h.data(), h.data(), count, BRAID_FLOAT16, BRAID_AVG, comm, nullptr));
        for (uint16_t v : h) ASSERT_EQ(v, kHalf24000) << algo << " float16 avg in place";
      }
      // min(+0, -0) and min(-0, +0) differ in their bits: every rank must
      // still get the same bits (the operands taken in the same order).
      for (braid_redop_t op : {BRAID_MIN, BRAID_MAX}) {
        float z[2] = {rank == 1 ? -0.0f : 0.0f, rank == 1 ? 0.0f : -0.0f}, got[2];
        BRAID_ASSERT_OK(braid_all_reduce(z, got, 2, BRAID_FLOAT32, op, comm, nullptr));
        uint32_t bits[2], all[6];
        std::memcpy(bits, got, sizeof(bits));
        BRAID_ASSERT_OK(braid_all_gather(bits, all, 2, BRAID_UINT32, comm, nullptr));
        for (int k = 1; k < 3; ++k)
          for (int e = 0; e < 2; ++e)
            ASSERT_EQ(all[2 * k + e], all[e]) << algo << " op " << op << ": rank " << k << " element " << e;
      }
    });
  }
}

TEST_P(Transports, DirectAllGatherAndReduceScatterInAndOutOfPlace) {
  // Forced direct runs up to one piece in all (256 KiB): 60000 int32 on 4
  // ranks is beyond it and falls back to the ring, which must agree.
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_ALGO", "direct"});
  run_ranks(4, env, [](braid_comm_t comm, int rank, int nranks) {
    auto value = [](int r, size_t i) { return static_cast<int32_t>(r * 1009 + static_cast<int>(i % 613)); };
    for (size_t count : {size_t{1}, size_t{7}, size_t{4097}, size_t{60000}}) {
      SCOPED_TRACE("count " + std::to_string(count));
      std::vector<int32_t> mine(count), all(count * nranks, -1);
      for (size_t i = 0; i < count; ++i) mine[i] = value(rank, i);
      BRAID_ASSERT_OK(braid_all_gather(mine.data(), all.data(), count, BRAID_INT32, comm, nullptr));
      for (int r = 0; r < nranks; ++r)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[r * count + i], value(r, i)) << "block " << r;
      std::fill(all.begin(), all.end(), -1);
      std::copy(mine.begin(), mine.end(), all.begin() + rank * count);
      BRAID_ASSERT_OK(
          braid_all_gather(all.data() + rank * count, all.data(), count, BRAID_INT32, comm, nullptr));
      for (int r = 0; r < nranks; ++r)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[r * count + i], value(r, i)) << "in place " << r;
      std::vector<int32_t> in(count * nranks), out(count, 0);
      for (size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i);
      auto expect_block = [&](const int32_t* got, int32_t times) {
        for (size_t i = 0; i < count; ++i) {
          int32_t sum = 0;
          for (int r = 0; r < nranks; ++r) sum += value(r, rank * count + i);
          ASSERT_EQ(got[i], sum * times) << i;
        }
      };
      BRAID_ASSERT_OK(
          braid_reduce_scatter(in.data(), out.data(), count, BRAID_INT32, BRAID_SUM, comm, nullptr));
      expect_block(out.data(), 1);
      BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), in.data() + rank * count, count, BRAID_INT32, BRAID_SUM,
                                           comm, nullptr));
      expect_block(in.data() + rank * count, 1);
      // AVG divides once, after every block is in.
      std::vector<double> d(count * nranks, 2.0 * (rank + 1)), avg(count, 0);
      BRAID_ASSERT_OK(
          braid_reduce_scatter(d.data(), avg.data(), count, BRAID_FLOAT64, BRAID_AVG, comm, nullptr));
      for (double v : avg) ASSERT_EQ(v, 5.0);
    }
  });
}

// A float16 AVG divides each input first (braid.h): three ranks of 12000,
// 24000 and 36000 sum past 65504, and every algorithm's result is 24000,
// in reduce and reduce_scatter too, in place and out.
TEST_P(Transports, AFloat16AverageWhoseSumPassesTheRangeFits) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
    for (size_t count : {size_t{3}, size_t{70001}}) {
      SCOPED_TRACE("count " + std::to_string(count));
      const std::vector<uint16_t> mine(count * nranks, kHalfOf[rank]);
      std::vector<uint16_t> in = mine, out(count, 0);
      const int root = 2;
      BRAID_ASSERT_OK(
          braid_reduce(in.data(), out.data(), count, BRAID_FLOAT16, BRAID_AVG, root, comm, nullptr));
      if (rank == root) {
        for (uint16_t v : out) ASSERT_EQ(v, kHalf24000) << "reduce";
      }
      BRAID_ASSERT_OK(
          braid_reduce(in.data(), in.data(), count, BRAID_FLOAT16, BRAID_AVG, root, comm, nullptr));
      if (rank == root) {
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], kHalf24000) << "reduce in place";
      }
      in = mine;
      BRAID_ASSERT_OK(
          braid_reduce_scatter(in.data(), out.data(), count, BRAID_FLOAT16, BRAID_AVG, comm, nullptr));
      for (uint16_t v : out) ASSERT_EQ(v, kHalf24000) << "reduce_scatter";
      EXPECT_EQ(in, mine) << "reduce_scatter changed its input";
      BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), in.data() + rank * count, count, BRAID_FLOAT16,
                                           BRAID_AVG, comm, nullptr));
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(in[rank * count + i], kHalf24000) << "reduce_scatter in place";
    }
  });
}

TEST_P(Transports, PeerReadCollectivesInAndOutOfPlace) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_ALGO", "peer_read"});
  run_ranks(3, env, [](braid_comm_t comm, int rank, int nranks) {
    const size_t count = 200003;  // several read chunks per block
    auto value = [](int r, size_t i) { return static_cast<int32_t>(r * 7 + static_cast<int>(i % 1000)); };
    // all_gather, out of place and in place (sendbuf = recvbuf + rank * count).
    std::vector<int32_t> mine(count), all(count * nranks, -1);
    for (size_t i = 0; i < count; ++i) mine[i] = value(rank, i);
    BRAID_ASSERT_OK(braid_all_gather(mine.data(), all.data(), count, BRAID_INT32, comm, nullptr));
    for (int r = 0; r < nranks; ++r)
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(all[r * count + i], value(r, i));
    std::fill(all.begin(), all.end(), -1);
    std::copy(mine.begin(), mine.end(), all.begin() + rank * count);
    BRAID_ASSERT_OK(
        braid_all_gather(all.data() + rank * count, all.data(), count, BRAID_INT32, comm, nullptr));
    for (int r = 0; r < nranks; ++r)
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(all[r * count + i], value(r, i));
    // reduce_scatter, out of place and in place (recvbuf = sendbuf + rank * count).
    std::vector<int32_t> in(count * nranks), out(count, 0);
    for (size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i);
    auto expect_block = [&](const int32_t* got) {
      for (size_t i = 0; i < count; ++i) {
        int32_t sum = 0;
        for (int r = 0; r < nranks; ++r) sum += value(r, rank * count + i);
        ASSERT_EQ(got[i], sum) << i;
      }
    };
    BRAID_ASSERT_OK(
        braid_reduce_scatter(in.data(), out.data(), count, BRAID_INT32, BRAID_SUM, comm, nullptr));
    expect_block(out.data());
    BRAID_ASSERT_OK(braid_reduce_scatter(in.data(), in.data() + rank * count, count, BRAID_INT32, BRAID_SUM,
                                         comm, nullptr));
    expect_block(in.data() + rank * count);
    // broadcast from a middle root, out of place and in place (where the
    // root writes the head of every receiver's buffer and they read the
    // rest): every element in its place, at sizes that split unevenly.
    for (size_t n : {size_t{5}, size_t{4099}, count}) {
      SCOPED_TRACE("broadcast of " + std::to_string(n));
      auto elem = [](size_t i) { return 0.5 + static_cast<double>(i % 4093); };
      std::vector<double> b(n, -1.0), c(n, -1.0);
      if (rank == 1)
        for (size_t i = 0; i < n; ++i) b[i] = elem(i);
      BRAID_ASSERT_OK(braid_broadcast(b.data(), c.data(), n, BRAID_FLOAT64, 1, comm, nullptr));
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(c[i], elem(i)) << i;
      BRAID_ASSERT_OK(braid_broadcast(b.data(), b.data(), n, BRAID_FLOAT64, 1, comm, nullptr));
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[i], elem(i)) << "in place " << i;
    }
  });
}

// Copies into shm slots made with streaming stores (every size, by the
// explicit band, also where ranks outnumber cores): exact bytes at odd
// sizes and alignments through broadcast, all_gather and point-to-point.
TEST(ShmStreamingCopies, ExactAtEverySizeAndAlignment) {
  const Env env = {
      {"BRAID_TRANSPORT", "shm"}, {"BRAID_SHM_STREAM_MIN_BYTES", "1"}, {"BRAID_SHM_STREAM_MAX_BYTES", "1G"}};
  for (int n : {2, 3}) {
    run_ranks(n, env, [](braid_comm_t comm, int rank, int nranks) {
      auto byte = [](int r, size_t i) { return static_cast<uint8_t>(r * 31 + i * 7 + i / 251); };
      for (size_t count : {size_t{1}, size_t{23}, size_t{1000}, size_t{16385}, size_t{300001}}) {
        // +1 and +3: neither buffer starts on a 16-byte line.
        std::vector<uint8_t> a(count * nranks + 8), b(count * nranks + 8, 0);
        uint8_t* in = a.data() + 1;
        uint8_t* out = b.data() + 3;
        for (size_t i = 0; i < count; ++i) in[i] = byte(rank, i);
        BRAID_ASSERT_OK(braid_broadcast(in, out, count, BRAID_UINT8, nranks - 1, comm, nullptr));
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], byte(nranks - 1, i)) << "broadcast " << count;
        BRAID_ASSERT_OK(braid_all_gather(in, out, count, BRAID_UINT8, comm, nullptr));
        for (int r = 0; r < nranks; ++r)
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(out[r * count + i], byte(r, i)) << "all_gather " << count << " block " << r;
        const int to = (rank + 1) % nranks, from = (rank + nranks - 1) % nranks;
        braid_request_t req;
        BRAID_ASSERT_OK(braid_irecv(out, count, BRAID_UINT8, from, comm, nullptr, &req));
        BRAID_ASSERT_OK(braid_send(in, count, BRAID_UINT8, to, comm, nullptr));
        BRAID_ASSERT_OK(braid_wait(&req));
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], byte(from, i)) << "recv " << count;
      }
    });
  }
}

TEST_P(Transports, GroupedRingExchangeDoesNotDeadlock) {
  run_ranks(4, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
    // 4 MiB each way: far more than the slots hold, so ungrouped blocking
    // sends would deadlock.
    const size_t count = 1 << 20;
    std::vector<int32_t> out(count), in(count, -1);
    for (size_t i = 0; i < count; ++i) out[i] = rank * 1000003 + static_cast<int32_t>(i);
    const int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    BRAID_ASSERT_OK(braid_group_start());
    BRAID_ASSERT_OK(braid_send(out.data(), count, BRAID_INT32, next, comm, nullptr));
    BRAID_ASSERT_OK(braid_recv(in.data(), count, BRAID_INT32, prev, comm, nullptr));
    BRAID_ASSERT_OK(braid_group_end());
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], prev * 1000003 + static_cast<int32_t>(i));
  });
}

// Grouped sends of 16 KiB and up between ranks that read each other's
// memory (shm) hand the receiver the buffer's address, and the two copy it
// straight from the sender's buffer into the receiver's, sharing the chunks
// (the counts show the 16-byte offer and the data once, where through slots
// the sender counts all of it). The send ends only once it is in. Sends that the slots hold whole copy
// unless grouped, so ranks that both send (or isend and wait) before they
// receive still get through; a blocking send larger than the slots offers.
// (With no init probe: where reading peers lost to slots there, sends take
// the slots.)
TEST(ShmPeerReads, LargeSendsAreCopiedStraightBetweenTheBuffers) {
  run_ranks(2, {{"BRAID_TRANSPORT", "shm"}, {"BRAID_TUNE_PROBE", "0"}}, [](braid_comm_t comm, int rank, int) {
    const int peer = 1 - rank;
    auto value = [](int r, size_t i) { return static_cast<int32_t>(r * 1000003 + static_cast<int32_t>(i)); };
    auto shm_bytes = [&] {
      uint64_t b = 0;
      EXPECT_EQ(braid_comm_transport_bytes(comm, "shm", &b), BRAID_SUCCESS);
      return b;
    };
    auto fill = [&](std::vector<int32_t>& v, int r) {
      for (size_t i = 0; i < v.size(); ++i) v[i] = value(r, i);
    };
    auto check = [&](const std::vector<int32_t>& v, int r, const char* what) {
      for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], value(r, i)) << what << " of " << v.size();
    };
    // What the ranks' shm counts grew by, for rank 0 sending `bytes` to
    // rank 1: through slots rank 0 sends it all; offered, rank 0 sends the
    // 16-byte offer and both copy their share of the data.
    auto expect_moved = [&](uint64_t before, uint64_t bytes, bool offered, const char* what) {
      uint64_t moved[2] = {0, 0};
      moved[rank] = shm_bytes() - before;
      BRAID_ASSERT_OK(braid_all_reduce(moved, moved, 2, BRAID_UINT64, BRAID_SUM, comm, nullptr));
      if (offered) {
        EXPECT_EQ(moved[0] + moved[1], bytes + 16) << what << " of " << bytes << " bytes";
        EXPECT_GE(moved[0], 16u) << what << " of " << bytes << " bytes";
      } else {
        EXPECT_EQ(moved[0], bytes) << what << " of " << bytes << " bytes";
        EXPECT_EQ(moved[1], 0u) << what << " of " << bytes << " bytes";
      }
    };
    struct Case {
      size_t count;
      bool grouped, read;
    };
    for (Case c : {Case{4095, true, false}, Case{4096, true, true}, Case{300001, true, true},
                   Case{65536, false, false}, Case{size_t{1} << 20, false, true}}) {
      std::vector<int32_t> buf(c.count, -1);
      const uint64_t before = shm_bytes();
      braid_request_t req;
      if (rank == 0) {
        fill(buf, 0);
        if (c.grouped) {
          BRAID_ASSERT_OK(braid_group_start());
        }
        BRAID_ASSERT_OK(braid_isend(buf.data(), c.count, BRAID_INT32, 1, comm, nullptr, &req));
        if (c.grouped) {
          BRAID_ASSERT_OK(braid_group_end());
        }
      } else {
        BRAID_ASSERT_OK(braid_irecv(buf.data(), c.count, BRAID_INT32, 0, comm, nullptr, &req));
      }
      BRAID_ASSERT_OK(braid_wait(&req));
      if (rank == 1) check(buf, 0, "irecv");
      expect_moved(before, c.count * sizeof(int32_t), c.read, c.grouped ? "grouped isend" : "isend");
    }
    // An offered send is not done before its receiver reads it.
    {
      std::vector<int32_t> buf(size_t{1} << 18, -1);
      if (rank == 0) {
        fill(buf, 0);
        braid_request_t req;
        BRAID_ASSERT_OK(braid_group_start());
        BRAID_ASSERT_OK(braid_isend(buf.data(), buf.size(), BRAID_INT32, 1, comm, nullptr, &req));
        BRAID_ASSERT_OK(braid_group_end());
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
        int done = 0;
        while (!done && std::chrono::steady_clock::now() < until) BRAID_ASSERT_OK(braid_test(&req, &done));
        EXPECT_EQ(done, 0) << "the send finished while its receiver slept";
        if (!done) {
          BRAID_ASSERT_OK(braid_wait(&req));
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        BRAID_ASSERT_OK(braid_recv(buf.data(), buf.size(), BRAID_INT32, 0, comm, nullptr));
        check(buf, 0, "recv after a sleep");
      }
    }
    // A receive from any source takes an offer too.
    {
      std::vector<int32_t> buf(16384, -1);
      const uint64_t before = shm_bytes();
      if (rank == 0) {
        fill(buf, 0);
        BRAID_ASSERT_OK(braid_group_start());
        BRAID_ASSERT_OK(braid_send(buf.data(), buf.size(), BRAID_INT32, 1, comm, nullptr));
        BRAID_ASSERT_OK(braid_group_end());
      } else {
        int source = -1;
        BRAID_ASSERT_OK(braid_recv_any(buf.data(), buf.size(), BRAID_INT32, &source, comm, nullptr));
        EXPECT_EQ(source, 0);
        check(buf, 0, "recv_any");
      }
      expect_moved(before, buf.size() * sizeof(int32_t), true, "grouped send to recv_any");
    }
    // Sends first on both ranks, 256 KiB each, blocking or isend and wait:
    // the slots hold them.
    for (bool isend : {false, true}) {
      std::vector<int32_t> out(65536), in(65536, -1);
      fill(out, rank);
      const uint64_t before = shm_bytes();
      if (isend) {
        braid_request_t req;
        BRAID_ASSERT_OK(braid_isend(out.data(), out.size(), BRAID_INT32, peer, comm, nullptr, &req));
        BRAID_ASSERT_OK(braid_wait(&req));
      } else {
        BRAID_ASSERT_OK(braid_send(out.data(), out.size(), BRAID_INT32, peer, comm, nullptr));
      }
      BRAID_ASSERT_OK(braid_recv(in.data(), in.size(), BRAID_INT32, peer, comm, nullptr));
      check(in, peer, "recv after both sent");
      EXPECT_EQ(shm_bytes() - before, out.size() * sizeof(int32_t));
    }
  });
}

// A block that waits unread while its receiver waits on a late rank is the
// call's, not a mismatch: each all_to_allv message carries its own size,
// and the watch over waiting messages took that for another call's (the
// torch suite's all_to_all failed now and then under load).
TEST_P(Transports, AllToAllvWithALateRank) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
    std::vector<size_t> sc(nranks, 3), sd(nranks), rc(nranks, 3), rd(nranks);
    for (int k = 0; k < nranks; ++k) sd[k] = rd[k] = 3 * static_cast<size_t>(k);
    std::vector<int32_t> in(9), out(9, -1), want(9);
    for (int k = 0; k < 9; ++k) {
      in[k] = rank * 100 + k;
      want[k] = (k / 3) * 100 + rank * 3 + k % 3;
    }
    if (rank == 2) usleep(300 * 1000);  // rank 1's block waits at rank 0 meanwhile
    BRAID_ASSERT_OK(braid_all_to_allv(in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(),
                                      BRAID_INT32, comm, nullptr));
    EXPECT_EQ(out, want);
  });
}

// Rank s sends (s + d + 1) * 3001 elements to rank d (some blocks span many
// slots, rank 0 sends nothing to itself when asked), packed in a permuted
// order with gaps, so displacements matter.
TEST_P(Transports, AllToAllvUnevenBlocks) {
  for (int n : {2, 3}) {
    run_ranks(n, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
      auto block = [](int s, int d) {
        return s == 0 && d == 0 ? size_t{0} : static_cast<size_t>(s + d + 1) * 3001;
      };
      std::vector<size_t> sc(nranks), sd(nranks), rc(nranks), rd(nranks);
      size_t soff = 7, roff = 3;
      for (int k = nranks - 1; k >= 0; --k) {  // blocks stored in reverse rank order
        sc[k] = block(rank, k);
        sd[k] = soff;
        soff += sc[k] + 5;
        rc[k] = block(k, rank);
        rd[k] = roff;
        roff += rc[k] + 2;
      }
      std::vector<int64_t> in(soff, -1), out(roff, -7);
      for (int d = 0; d < nranks; ++d)
        for (size_t i = 0; i < sc[d]; ++i)
          in[sd[d] + i] = rank * 1000000000LL + d * 1000000LL + static_cast<int64_t>(i);
      BRAID_ASSERT_OK(braid_all_to_allv(in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(),
                                        BRAID_INT64, comm, nullptr));
      std::vector<int64_t> want(roff, -7);
      for (int s = 0; s < nranks; ++s)
        for (size_t i = 0; i < rc[s]; ++i)
          want[rd[s] + i] = s * 1000000000LL + rank * 1000000LL + static_cast<int64_t>(i);
      ASSERT_EQ(out, want);

      // A receiver expecting a different size: both sides get an error.
      std::vector<size_t> bad = rc;
      int from = (rank + 1) % nranks;
      if (rank == 0) bad[from] += 1;
      braid_request_t req = nullptr;
      std::vector<int64_t> big(roff + 16);
      BRAID_ASSERT_OK(braid_iall_to_allv(in.data(), sc.data(), sd.data(), big.data(), bad.data(), rd.data(),
                                         BRAID_INT64, comm, nullptr, &req));
      braid_result_t r = braid_wait(&req);
      if (rank == 0) {
        EXPECT_EQ(r, BRAID_ERR_MISMATCH) << braid_get_last_error();
        EXPECT_NE(std::string(braid_get_last_error()).find("all_to_allv"), std::string::npos)
            << braid_get_last_error();
      }
    });
  }
}

TEST(AllToAllvArguments, BadLayoutsNameTheProblem) {
  run_ranks(2, {}, [](braid_comm_t comm, int rank, int) {
    size_t sc[2] = {1, 1}, sd[2] = {0, 1}, rc[2] = {1, 1}, rd[2] = {0, 1};
    int32_t in[2] = {rank, rank}, out[2] = {};
    EXPECT_EQ(braid_all_to_allv(in, sc, sd, out, nullptr, rd, BRAID_INT32, comm, nullptr),
              BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(braid_get_last_error()).find("all_to_allv: recvcounts is NULL"), std::string::npos)
        << braid_get_last_error();
    EXPECT_EQ(braid_all_to_allv(in, sc, nullptr, out, rc, rd, BRAID_INT32, comm, nullptr),
              BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(braid_get_last_error()).find("sdispls is NULL"), std::string::npos)
        << braid_get_last_error();
    // A NULL buffer names the rank whose count needs it.
    EXPECT_EQ(braid_all_to_allv(in, sc, sd, nullptr, rc, rd, BRAID_INT32, comm, nullptr),
              BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(braid_get_last_error()).find("recvbuf is NULL with recvcounts[0]=1"),
              std::string::npos)
        << braid_get_last_error();
    size_t self_mismatch[2] = {2, 2};
    EXPECT_EQ(braid_all_to_allv(in, sc, sd, out, self_mismatch, rd, BRAID_INT32, comm, nullptr),
              BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(braid_get_last_error()).find("block to itself"), std::string::npos)
        << braid_get_last_error();
    size_t huge[2] = {SIZE_MAX / 2, SIZE_MAX / 2};
    EXPECT_EQ(braid_all_to_allv(in, sc, huge, out, rc, rd, BRAID_INT32, comm, nullptr),
              BRAID_ERR_INVALID_ARGUMENT);
    BRAID_EXPECT_OK(braid_all_to_allv(in, sc, sd, out, rc, rd, BRAID_INT32, comm, nullptr));
    EXPECT_EQ(out[0], 0);
    EXPECT_EQ(out[1], 1);
  });
}

// Receives from any source: every message arrives once, the reported
// source is the sender, and per-sender order holds (a specific receive
// posted before takes that peer's first message).
TEST_P(Transports, ReceiveFromAnySource) {
  run_ranks(4, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
    const size_t count = 70001;  // several slots
    if (rank != 0) {
      std::vector<int32_t> first(count, rank * 10 + 1), second(count, rank * 10 + 2);
      BRAID_ASSERT_OK(braid_send(first.data(), count, BRAID_INT32, 0, comm, nullptr));
      BRAID_ASSERT_OK(braid_send(second.data(), count, BRAID_INT32, 0, comm, nullptr));
      return;
    }
    // Rank 3's first message goes to this specific receive, posted first.
    std::vector<int32_t> from3(count, 0);
    braid_request_t specific = nullptr;
    BRAID_ASSERT_OK(braid_irecv(from3.data(), count, BRAID_INT32, 3, comm, nullptr, &specific));
    const int kAny = 2 * (nranks - 1) - 1;
    std::vector<std::vector<int32_t>> bufs(kAny, std::vector<int32_t>(count, 0));
    std::vector<int> sources(kAny, -1);
    std::vector<braid_request_t> reqs(kAny);
    for (int i = 0; i < kAny; ++i)
      BRAID_ASSERT_OK(
          braid_irecv_any(bufs[i].data(), count, BRAID_INT32, &sources[i], comm, nullptr, &reqs[i]));
    BRAID_ASSERT_OK(braid_wait(&specific));
    for (int32_t v : from3) ASSERT_EQ(v, 31);
    BRAID_ASSERT_OK(braid_wait_all(kAny, reqs.data()));
    std::vector<int> seen(nranks, 0);
    for (int i = 0; i < kAny; ++i) {
      ASSERT_GE(sources[i], 1);
      ASSERT_LT(sources[i], nranks);
      int s = sources[i];
      ++seen[s];
      // The k-th message from s (counting rank 3's first, taken above).
      int nth = seen[s] + (s == 3 ? 1 : 0);
      for (int32_t v : bufs[i]) ASSERT_EQ(v, s * 10 + nth) << "message " << i << " from rank " << s;
    }
    EXPECT_EQ(seen[1], 2);
    EXPECT_EQ(seen[2], 2);
    EXPECT_EQ(seen[3], 1);
    // Blocking form, from this rank itself.
    int32_t self_msg = 77, got = 0;
    int src = -1;
    braid_request_t sreq = nullptr;
    BRAID_ASSERT_OK(braid_isend(&self_msg, 1, BRAID_INT32, 0, comm, nullptr, &sreq));
    BRAID_ASSERT_OK(braid_recv_any(&got, 1, BRAID_INT32, &src, comm, nullptr));
    BRAID_ASSERT_OK(braid_wait(&sreq));
    EXPECT_EQ(got, 77);
    EXPECT_EQ(src, 0);
    EXPECT_EQ(braid_recv_any(&got, 1, BRAID_INT32, nullptr, comm, nullptr), BRAID_ERR_INVALID_ARGUMENT);
  });
}

TEST_P(Transports, MessagesBetweenTwoRanksMatchInOrder) {
  run_ranks(2, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    const int kMessages = 6;
    std::vector<std::vector<uint8_t>> bufs(kMessages);
    std::vector<braid_request_t> reqs(kMessages);
    for (int m = 0; m < kMessages; ++m) {
      size_t len = static_cast<size_t>(m) * 70001;  // 0 bytes, then up to several slots
      bufs[m].assign(len, rank == 0 ? static_cast<uint8_t>(m + 1) : 0);
      if (rank == 0) {
        BRAID_ASSERT_OK(braid_isend(bufs[m].data(), len, BRAID_UINT8, 1, comm, nullptr, &reqs[m]));
      } else {
        BRAID_ASSERT_OK(braid_irecv(bufs[m].data(), len, BRAID_UINT8, 0, comm, nullptr, &reqs[m]));
      }
    }
    // Poll one with braid_test until done, then wait for the rest.
    int done = 0;
    while (!done) BRAID_ASSERT_OK(braid_test(&reqs[kMessages - 1], &done));
    EXPECT_EQ(reqs[kMessages - 1], nullptr);
    BRAID_ASSERT_OK(braid_wait_all(kMessages, reqs.data()));
    for (int m = 0; m < kMessages; ++m)
      for (uint8_t b : bufs[m]) ASSERT_EQ(b, m + 1);
  });
}

// Tags are checked, not matched: receives in the senders' tag order get
// their messages; a receive whose matching send has another tag fails with
// BRAID_ERR_MISMATCH naming both tags (small, and large enough to be read
// in place), where it took the other message's bytes before.
TEST_P(Transports, PointToPointTagsAreCheckedInPostOrder) {
  for (size_t len : {size_t{64}, size_t{4} << 20}) {
    run_ranks(2, transport_env(GetParam()), [len](braid_comm_t comm, int rank, int) {
      std::vector<uint8_t> a(len, rank == 0 ? 1 : 0), b(len, rank == 0 ? 2 : 0);
      braid_request_t reqs[2];
      if (rank == 0) {
        BRAID_ASSERT_OK(braid_isend_tagged(a.data(), len, BRAID_UINT8, 1, 1, comm, nullptr, &reqs[0]));
        BRAID_ASSERT_OK(braid_isend_tagged(b.data(), len, BRAID_UINT8, 1, 2, comm, nullptr, &reqs[1]));
        BRAID_ASSERT_OK(braid_wait_all(2, reqs));
        int source = -1;
        BRAID_ASSERT_OK(braid_recv_any_tagged(a.data(), len, BRAID_UINT8, &source, 7, comm, nullptr));
        EXPECT_EQ(source, 1);
        // This one's receiver expects tag 4: the send may fail or not
        // (its bytes may have left), the receive must.
        braid_send_tagged(b.data(), len, BRAID_UINT8, 1, 3, comm, nullptr);
      } else {
        BRAID_ASSERT_OK(braid_irecv_tagged(a.data(), len, BRAID_UINT8, 0, 1, comm, nullptr, &reqs[0]));
        BRAID_ASSERT_OK(braid_recv_tagged(b.data(), len, BRAID_UINT8, 0, 2, comm, nullptr));
        BRAID_ASSERT_OK(braid_wait(&reqs[0]));
        for (size_t i = 0; i < len; ++i) ASSERT_TRUE(a[i] == 1 && b[i] == 2) << i;
        BRAID_ASSERT_OK(braid_send_tagged(a.data(), len, BRAID_UINT8, 0, 7, comm, nullptr));
        std::fill(b.begin(), b.end(), 0);
        EXPECT_EQ(braid_recv_tagged(b.data(), len, BRAID_UINT8, 0, 4, comm, nullptr), BRAID_ERR_MISMATCH);
        const std::string m = braid_get_last_error();
        EXPECT_NE(m.find("with tag 4"), std::string::npos) << m;
        EXPECT_NE(m.find("with tag 3"), std::string::npos) << m;
        for (size_t i = 0; i < len; ++i) ASSERT_EQ(b[i], 0) << "a mismatched message wrote byte " << i;
      }
    });
  }
}

// Packed shm slots: a sender far ahead of its receiver, with sizes that pack
// several to a slot, close a packed slot early (a large message after small
// ones) and fill it exactly. First, rounds of two 9000-byte messages and ten
// 16-byte ones: with 2 slots the small ones land where a large payload lay,
// and that payload holds the very numbers they carry (for each count of
// messages sent before, 0 to 15), so a stale payload taken for a message
// header would be caught. Then a mix of sizes while the receiver sleeps.
TEST_P(Transports, SmallAndLargeMessagesRunAheadOfASlowReceiver) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_SHM_SLOTS", "2"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    struct Message {
      size_t bytes;
      uint64_t base;  // word w of the payload is base + (w + 5) / 8
    };
    std::vector<Message> plan;
    const int kRounds = 64, kPerRound = 12;
    for (int r = 0; r < kRounds; ++r) {
      // A header at byte 64k of a slot lies on word 8k - 5 of a payload that
      // began at byte 40, and there the k-th message after the next slot's
      // first one would carry number kPerRound * r + 3 + k (+ earlier traffic).
      const uint64_t base = static_cast<uint64_t>(kPerRound * r + 3 + r % 16);
      plan.push_back({9000, base});
      plan.push_back({9000, base});
      for (int i = 2; i < kPerRound; ++i) plan.push_back({16, static_cast<uint64_t>(r)});
    }
    const size_t kSizes[] = {0, 8, 24, 25, 40, 100, 600, 984, 985, 1500, 9000, 300000, 16, 16, 16};
    for (int m = 0; m < 300; ++m) plan.push_back({kSizes[m % std::size(kSizes)], static_cast<uint64_t>(m)});
    auto payload = [](const Message& msg) {
      std::vector<uint8_t> buf(msg.bytes);
      for (size_t i = 0; i < buf.size(); ++i) {
        const uint64_t word = msg.base + (i / 8 + 5) / 8;
        buf[i] = static_cast<uint8_t>(word >> (8 * (i % 8)));
      }
      return buf;
    };
    for (size_t m = 0; m < plan.size(); ++m) {
      const std::vector<uint8_t> want = payload(plan[m]);
      if (rank == 0) {
        // The receiver then waits where this message goes, on the old payload.
        if (m < plan.size() - 300 && m % kPerRound == 3) usleep(200);
        BRAID_ASSERT_OK(braid_send(want.data(), want.size(), BRAID_UINT8, 1, comm, nullptr));
      } else {
        if (m == static_cast<size_t>(kRounds * kPerRound)) usleep(100 * 1000);  // the sender fills every slot
        std::vector<uint8_t> got(want.size(), 0xEE);
        BRAID_ASSERT_OK(braid_recv(got.data(), got.size(), BRAID_UINT8, 0, comm, nullptr));
        ASSERT_EQ(got, want) << "message " << m << " of " << want.size() << " bytes";
      }
    }
  });
}

// Grouped small sends and receives are done at braid_group_end without ops
// where slots are free and messages are in (Communicator::run_p2p_inline),
// by ops otherwise, and partly each way where slots fill (two of 4 KiB) or
// a peer is late. A call of the group that needs an op (a large send) makes
// the calls before it ops first. Every message must arrive whole, in each
// peer's order.
TEST_P(Transports, SmallGroupedSendsAndReceivesDoneInlineOrByOpsAgree) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_SHM_SLOTS", "2"});
  env.push_back({"BRAID_SHM_SLOT_BYTES", "4096"});
  run_ranks(4, env, [](braid_comm_t comm, int rank, int nranks) {
    const size_t kSizes[] = {0, 4, 24, 1000, 3000};
    const size_t kLarge = 40000;  // past a slot and the size read in place: an op
    auto payload = [](int i, int from, int to, int j, size_t bytes) {
      std::vector<uint8_t> b(bytes);
      for (size_t k = 0; k < bytes; ++k) b[k] = static_cast<uint8_t>(i * 31 + from * 7 + to * 3 + j * 11 + k);
      return b;
    };
    struct Message {
      int peer, j;
      std::vector<uint8_t> buf;
    };
    for (int i = 0; i < 300; ++i) {
      const int per_peer = 1 + i % 3;
      const bool large = i % 10 == 4;
      if (rank == (i / 25) % nranks && i % 25 == 5) usleep(20 * 1000);  // the others run ahead
      std::vector<Message> sends, recvs;
      for (int s = 1; s < nranks; ++s) {
        for (int j = 0; j < per_peer + large; ++j) {
          const size_t bytes = large && j == 1 ? kLarge : kSizes[(i + s + j) % std::size(kSizes)];
          const int to = (rank + s) % nranks, from = (rank + nranks - s) % nranks;
          sends.push_back({to, j, payload(i, rank, to, j, bytes)});
          recvs.push_back({from, j, std::vector<uint8_t>(bytes, 0xEE)});
        }
      }
      BRAID_ASSERT_OK(braid_group_start());
      for (size_t k = 0; k < sends.size(); ++k) {
        BRAID_ASSERT_OK(
            braid_send(sends[k].buf.data(), sends[k].buf.size(), BRAID_UINT8, sends[k].peer, comm, nullptr));
        BRAID_ASSERT_OK(
            braid_recv(recvs[k].buf.data(), recvs[k].buf.size(), BRAID_UINT8, recvs[k].peer, comm, nullptr));
      }
      BRAID_ASSERT_OK(braid_group_end());
      for (const Message& m : recvs)
        ASSERT_EQ(m.buf, payload(i, m.peer, rank, m.j, m.buf.size()))
            << "group " << i << ", message " << m.j << " from rank " << m.peer;
    }
  });
}

// Two slots per peer (a root runs only that far ahead of a child) and
// `algo` forced.
Env two_slot_env(const std::string& transport, const char* algo) {
  Env env = transport_env(transport);
  env.push_back({"BRAID_SHM_SLOTS", "2"});
  env.push_back({"BRAID_ALGO", algo});
  return env;
}

// Small broadcasts are done inline, without an op, where the message is in
// and the slots are free (Communicator::run_inline), and by an op otherwise:
// roots that run ahead until the slots fill, receivers that sleep, a pending
// receive that keeps the engine busy, and all_reduces between, over the
// chain and the tree, must all deliver every broadcast whole and in order.
TEST_P(Transports, SmallBroadcastsFromEveryRootArriveWholeAndInOrder) {
  for (const char* algo : {"broadcast:chain", "broadcast:tree"}) {
    run_ranks(4, two_slot_env(GetParam(), algo), [algo](braid_comm_t comm, int rank, int nranks) {
      int32_t pending = -1;
      braid_request_t req = nullptr;
      for (int i = 0; i < 400; ++i) {
        const int root = (i / 7) % nranks;
        const size_t count = 1 + static_cast<size_t>(i * 37 % 300);
        std::vector<int32_t> buf(count, -1), want(count);
        for (size_t k = 0; k < count; ++k) want[k] = i * 1000 + static_cast<int32_t>(k);
        if (rank == root) buf = want;
        if (rank == (i / 50) % nranks && i % 50 == 10) usleep(20 * 1000);  // the others run ahead
        // Ranks 1 and 2: a receive pending from call 100 to 200.
        if (i == 100 && (rank == 1 || rank == 2)) {
          BRAID_ASSERT_OK(braid_irecv(&pending, 1, BRAID_INT32, 3 - rank, comm, nullptr, &req));
        }
        if (i == 200 && (rank == 1 || rank == 2)) {
          int32_t mine = rank;
          BRAID_ASSERT_OK(braid_send(&mine, 1, BRAID_INT32, 3 - rank, comm, nullptr));
          BRAID_ASSERT_OK(braid_wait(&req));
          EXPECT_EQ(pending, 3 - rank);
        }
        BRAID_ASSERT_OK(braid_broadcast(buf.data(), buf.data(), count, BRAID_INT32, root, comm, nullptr));
        ASSERT_EQ(buf, want) << algo << ", call " << i << ", root " << root;
        if (i % 25 == 24) {
          int64_t x = i + rank, sum = 0;
          BRAID_ASSERT_OK(braid_all_reduce(&x, &sum, 1, BRAID_INT64, BRAID_SUM, comm, nullptr));
          ASSERT_EQ(sum, 4 * i + 6) << algo << ", after call " << i;
        }
      }
    });
  }
}

// Small reduces, like small broadcasts, are done inline where every child's
// piece is in and the parent's slot is free, and by an op otherwise; the
// chain reduce is the tree reduce over the chain. Every root gets the exact
// sum and average, and no other rank's output is written.
TEST_P(Transports, SmallReducesToEveryRootAddUpWhetherInlineOrNot) {
  for (const char* algo : {"reduce:chain", "reduce:tree"}) {
    run_ranks(4, two_slot_env(GetParam(), algo), [algo](braid_comm_t comm, int rank, int nranks) {
      for (int i = 0; i < 300; ++i) {
        const int root = (i / 7) % nranks;
        const size_t count = 1 + static_cast<size_t>(i * 29 % 200);
        if (rank == (i / 40) % nranks && i % 40 == 5) usleep(20 * 1000);  // the others run ahead
        std::vector<int64_t> in(count), out(count, -1);
        for (size_t k = 0; k < count; ++k) in[k] = (rank + 1) * 1000 + i + static_cast<int64_t>(k);
        int64_t* dst = i % 3 == 0 ? in.data() : out.data();  // in place every third call
        BRAID_ASSERT_OK(braid_reduce(in.data(), dst, count, BRAID_INT64, BRAID_SUM, root, comm, nullptr));
        for (size_t k = 0; k < count; ++k) {
          const int64_t sum = 10 * 1000 + 4 * (i + static_cast<int64_t>(k));
          if (rank == root) {
            ASSERT_EQ(dst[k], sum) << algo << ", call " << i << ", root " << root;
          } else if (dst == out.data()) {
            ASSERT_EQ(dst[k], -1) << algo << ": a rank other than the root had its output written, call "
                                  << i;
          }
        }
        float x = static_cast<float>(2 * rank + i % 5), avg = -1.0f;
        BRAID_ASSERT_OK(braid_reduce(&x, &avg, 1, BRAID_FLOAT32, BRAID_AVG, root, comm, nullptr));
        if (rank == root) {
          ASSERT_EQ(avg, static_cast<float>(3 + i % 5)) << algo << ", call " << i;
        }
      }
    });
  }
}

// Small gathers and scatters are done inline, each rank's part whole or not
// at all (a root's sends once every slot is free, its receives once every
// block is in), and by an op otherwise: rotating roots, two slots that a
// root running ahead fills, a rank asleep by turns. Every block must land
// whole in its place, and nothing else be written.
TEST_P(Transports, SmallGathersAndScattersFromEveryRootLandInPlace) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_SHM_SLOTS", "2"});
  run_ranks(4, env, [](braid_comm_t comm, int rank, int nranks) {
    auto value = [](int i, int from, int to, size_t k) {
      return i * 10000 + from * 1000 + to * 100 + static_cast<int32_t>(k);
    };
    for (int i = 0; i < 300; ++i) {
      const int root = (i / 5) % nranks;
      const size_t count = 1 + static_cast<size_t>(i * 29 % 200);
      if (rank == (i / 40) % nranks && i % 40 == 7) usleep(20 * 1000);  // the others run ahead
      // gather: rank r's block lands at r on the root.
      std::vector<int32_t> mine(count), all(count * nranks, -1);
      for (size_t k = 0; k < count; ++k) mine[k] = value(i, rank, root, k);
      BRAID_ASSERT_OK(braid_gather(mine.data(), all.data(), count, BRAID_INT32, root, comm, nullptr));
      for (int r = 0; r < nranks; ++r)
        for (size_t k = 0; k < count; ++k)
          ASSERT_EQ(all[r * count + k], rank == root ? value(i, r, root, k) : -1)
              << "gather " << i << ", root " << root << ", block of rank " << r;
      // scatter: the root's block p lands on rank p.
      std::vector<int32_t> blocks(count * nranks), got(count, -1);
      for (int p = 0; p < nranks; ++p)
        for (size_t k = 0; k < count; ++k) blocks[p * count + k] = value(i, root, p, k);
      BRAID_ASSERT_OK(braid_scatter(blocks.data(), got.data(), count, BRAID_INT32, root, comm, nullptr));
      for (size_t k = 0; k < count; ++k)
        ASSERT_EQ(got[k], value(i, root, rank, k)) << "scatter " << i << ", root " << root;
    }
  });
}

// Small all_reduces, all_gathers and reduce_scatters run direct (all_to_alls
// pairwise, the same messages), and on shm
// inline where they can (Communicator::run_inline): whole where every
// peer's message is in, else their sends inline and the rest by an op.
// Ranks that come late by turns make each case happen; every result is
// exact, in place and out, with an op whose operand order shows (MAX of
// +0 and -0 keeps the first: the op's order everywhere) and AVG.
TEST_P(Transports, SmallDirectCollectivesDoneInlineOrByOpsAgree) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int nranks) {
    for (int i = 0; i < 240; ++i) {
      if (rank == (i / 20) % nranks && i % 20 < 3) usleep(2000);  // a late rank, by turns
      const size_t count = 1 + static_cast<size_t>(i * 13 % 50);
      const bool in_place = i % 2 == 1;
      auto value = [&](int r, size_t k) {
        return static_cast<float>((r + 1) * 100 + static_cast<int>(k) + i);
      };
      // all_reduce: SUM, then MAX over +0/-0 (rank 0 gives -0), then AVG.
      std::vector<float> in(count), out(count, -1.0f);
      for (size_t k = 0; k < count; ++k) in[k] = value(rank, k);
      float* dst = in_place ? in.data() : out.data();
      BRAID_ASSERT_OK(braid_all_reduce(in.data(), dst, count, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
      for (size_t k = 0; k < count; ++k)
        ASSERT_EQ(dst[k], value(0, k) + value(1, k) + value(2, k)) << "all_reduce sum, call " << i;
      float z = rank == 0 ? -0.0f : 0.0f, zmax = 1.0f;
      BRAID_ASSERT_OK(
          braid_all_reduce(&z, in_place ? &z : &zmax, 1, BRAID_FLOAT32, BRAID_MAX, comm, nullptr));
      EXPECT_TRUE(std::signbit(in_place ? z : zmax)) << "max of -0 and +0 keeps rank 0's -0, call " << i;
      for (size_t k = 0; k < count; ++k) in[k] = value(rank, k);
      BRAID_ASSERT_OK(braid_all_reduce(in.data(), dst, count, BRAID_FLOAT32, BRAID_AVG, comm, nullptr));
      for (size_t k = 0; k < count; ++k)
        ASSERT_EQ(dst[k], (value(0, k) + value(1, k) + value(2, k)) / 3) << "all_reduce avg, call " << i;
      // all_gather: rank r's block at r.
      std::vector<int32_t> gathered(count * nranks, -1), block(count);
      for (size_t k = 0; k < count; ++k) block[k] = rank * 100000 + i * 100 + static_cast<int32_t>(k);
      if (in_place) std::copy(block.begin(), block.end(), gathered.begin() + rank * count);
      BRAID_ASSERT_OK(braid_all_gather(in_place ? gathered.data() + rank * count : block.data(),
                                       gathered.data(), count, BRAID_INT32, comm, nullptr));
      for (int r = 0; r < nranks; ++r)
        for (size_t k = 0; k < count; ++k)
          ASSERT_EQ(gathered[r * count + k], r * 100000 + i * 100 + static_cast<int32_t>(k))
              << "all_gather, call " << i;
      // reduce_scatter: block b of rank r holds r + b + k.
      std::vector<int64_t> scatter_in(count * nranks), scatter_out(count, -1);
      for (int b = 0; b < nranks; ++b)
        for (size_t k = 0; k < count; ++k)
          scatter_in[b * count + k] = rank * 1000 + b * 10 + static_cast<int64_t>(k);
      int64_t* rs_out = in_place ? scatter_in.data() + rank * count : scatter_out.data();
      BRAID_ASSERT_OK(
          braid_reduce_scatter(scatter_in.data(), rs_out, count, BRAID_INT64, BRAID_SUM, comm, nullptr));
      for (size_t k = 0; k < count; ++k)
        ASSERT_EQ(rs_out[k], (0 + 1000 + 2000) + 3 * (rank * 10 + static_cast<int64_t>(k)))
            << "reduce_scatter, call " << i;
      // all_to_all: rank r's block b goes to rank b, which keeps it at r.
      auto sent = [&](int from, int to, size_t k) {
        return static_cast<uint8_t>(from * 50 + to * 7 + static_cast<int>(k) + i);
      };
      std::vector<uint8_t> a2a_in(count * nranks), a2a_out(count * nranks, 0xEE);
      for (int b = 0; b < nranks; ++b)
        for (size_t k = 0; k < count; ++k) a2a_in[b * count + k] = sent(rank, b, k);
      uint8_t* a2a_dst = in_place ? a2a_in.data() : a2a_out.data();
      BRAID_ASSERT_OK(braid_all_to_all(a2a_in.data(), a2a_dst, count, BRAID_UINT8, comm, nullptr));
      for (int r = 0; r < nranks; ++r)
        for (size_t k = 0; k < count; ++k)
          ASSERT_EQ(a2a_dst[r * count + k], sent(r, rank, k))
              << "all_to_all from rank " << r << ", call " << i;
    }
  });
}

TEST_P(Transports, PendingReceiveDoesNotBlockCollectives) {
  run_ranks(2, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    int64_t msg = rank == 1 ? 42 : 0;
    braid_request_t req = nullptr;
    // Rank 0 waits for a message rank 1 sends only after the all_reduce.
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_irecv(&msg, 1, BRAID_INT64, 1, comm, nullptr, &req));
    }
    int64_t x = rank + 1, sum = 0;
    BRAID_ASSERT_OK(braid_all_reduce(&x, &sum, 1, BRAID_INT64, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(sum, 3);
    if (rank == 1) {
      BRAID_ASSERT_OK(braid_send(&msg, 1, BRAID_INT64, 0, comm, nullptr));
    }
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_wait(&req));
      EXPECT_EQ(msg, 42);
    }
  });
}

// A large isend the peer receives only after two collectives: the first
// collective must complete once its own bytes are sent, not wait behind the
// isend's (the peer's second collective waits for this rank's second).
TEST_P(Transports, ACollectiveDoesNotWaitForAnEarlierIsendsBytes) {
  Env env = transport_env(GetParam());
  // Waiting on each other's next call, the ranks would fail their
  // all_reduces with BRAID_ERR_TIMEOUT at this deadline.
  env.push_back({"BRAID_TIMEOUT", "20"});
  env.push_back({"BRAID_TCP_BUFFER_BYTES", "64K"});
  run_ranks(2, env, [](braid_comm_t comm, int rank, int) {
    std::vector<float> big(16 << 20, rank == 0 ? 2.5f : 0.0f);  // 64 MiB: past every slot and socket buffer
    braid_request_t req = nullptr;
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_isend(big.data(), big.size(), BRAID_FLOAT32, 1, comm, nullptr, &req));
    }
    for (int k = 0; k < 2; ++k) {
      int64_t x = rank + k, sum = 0;
      BRAID_ASSERT_OK(braid_all_reduce(&x, &sum, 1, BRAID_INT64, BRAID_SUM, comm, nullptr));
      EXPECT_EQ(sum, 1 + 2 * k);
    }
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_wait(&req));
    } else {
      BRAID_ASSERT_OK(braid_recv(big.data(), big.size(), BRAID_FLOAT32, 0, comm, nullptr));
      EXPECT_EQ(big.front(), 2.5f);
      EXPECT_EQ(big.back(), 2.5f);
    }
  });
}

// A blocking send returns with its bytes handed to the kernel: a rank that
// then waits outside braid (here on a pipe the receiver writes once it has
// them) must not hold back its peer's receive. tcp keeps frames in staging
// slots until the socket takes them, so the send's own frames must be flushed.
TEST_P(Transports, ABlockingSendsBytesLeaveBeforeItReturns) {
  Env env = transport_env(GetParam());
  env.push_back({"BRAID_TIMEOUT", "10"});
  env.push_back({"BRAID_TCP_BUFFER_BYTES", "64K"});
  int received[2];
  ASSERT_EQ(pipe(received), 0);
  run_ranks(2, env, [&received](braid_comm_t comm, int rank, int) {
    std::vector<float> buf(1 << 20, rank == 0 ? 4.5f : 0.0f);  // 4 MiB: more than the socket takes at once
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_send(buf.data(), buf.size(), BRAID_FLOAT32, 1, comm, nullptr));
      pollfd p{received[0], POLLIN, 0};
      ASSERT_EQ(poll(&p, 1, 20000), 1) << "rank 1 did not receive while rank 0 made no braid call";
    } else {
      BRAID_ASSERT_OK(braid_recv(buf.data(), buf.size(), BRAID_FLOAT32, 0, comm, nullptr));
      for (float v : buf) ASSERT_EQ(v, 4.5f);
      const char one = 1;
      ASSERT_EQ(write(received[1], &one, 1), 1);
    }
  });
  close(received[0]);
  close(received[1]);
}

TEST_P(Transports, NonBlockingOperationsProgressWithoutTheCaller) {
  run_ranks(2, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    // 8 MiB: many pieces, so it completes only if something keeps moving
    // them. braid_test only looks; it never drives the engine.
    std::vector<float> buf(2 << 20, rank == 0 ? 1.5f : 0.0f);
    braid_request_t req = nullptr;
    if (rank == 0) {
      BRAID_ASSERT_OK(braid_isend(buf.data(), buf.size(), BRAID_FLOAT32, 1, comm, nullptr, &req));
    } else {
      BRAID_ASSERT_OK(braid_irecv(buf.data(), buf.size(), BRAID_FLOAT32, 0, comm, nullptr, &req));
    }
    int done = 0;
    for (int i = 0; i < 2000 && !done; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      BRAID_ASSERT_OK(braid_test(&req, &done));
    }
    ASSERT_EQ(done, 1) << "the operation did not complete while the caller slept";
    for (float v : buf) ASSERT_EQ(v, 1.5f);
  });
}

// Completion callbacks: each fires once, without anyone waiting, with the
// operation's result; the request stays usable afterwards.
struct CallbackLog {
  std::atomic<int> calls{0};
  std::atomic<int> result{-1};
};

void record_callback(void* user, braid_result_t result, const char*) {
  auto* log = static_cast<CallbackLog*>(user);
  log->result.store(result);
  log->calls.fetch_add(1);
}

TEST_P(Transports, CompletionCallbacksFireWithoutAWaiter) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    std::vector<double> buf(1 << 18, rank + 1.0);
    CallbackLog log;
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(
        braid_iall_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT64, BRAID_SUM, comm, nullptr, &req));
    BRAID_ASSERT_OK(braid_request_set_callback(req, record_callback, &log));
    EXPECT_EQ(braid_request_set_callback(req, record_callback, &log), BRAID_ERR_INVALID_USAGE);
    for (int i = 0; i < 2000 && log.calls.load() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_EQ(log.calls.load(), 1) << "the callback did not run while the caller slept";
    EXPECT_EQ(log.result.load(), BRAID_SUCCESS);
    for (double v : buf) ASSERT_EQ(v, 6.0);
    BRAID_EXPECT_OK(braid_wait(&req));
    EXPECT_EQ(log.calls.load(), 1);

    // Set after completion: it runs at once, on this thread. Collectives
    // complete in order, so the ibarrier is done once the barrier returns.
    CallbackLog late;
    BRAID_ASSERT_OK(braid_ibarrier(comm, nullptr, &req));
    BRAID_ASSERT_OK(braid_barrier(comm, nullptr));
    BRAID_ASSERT_OK(braid_request_set_callback(req, record_callback, &late));
    EXPECT_EQ(late.calls.load(), 1);
    EXPECT_EQ(late.result.load(), BRAID_SUCCESS);
    BRAID_EXPECT_OK(braid_wait(&req));
    braid_request_t stale = nullptr;
    BRAID_ASSERT_OK(braid_ibarrier(comm, nullptr, &stale));
    braid_request_t copy = stale;
    BRAID_ASSERT_OK(braid_wait(&stale));
    EXPECT_EQ(braid_request_set_callback(copy, record_callback, &late), BRAID_ERR_INVALID_ARGUMENT);
  });
}

// The thread that completes an op publishes it done, wakes its waiter, then
// runs its callback. braid_wait must not return before that callback has
// returned: its caller may free what the callback uses.
TEST_P(Transports, WaitReturnsOnlyOnceTheCallbackHasReturned) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    int32_t v = rank;
    if (rank != 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rank == 1 ? 900 : 300));
      BRAID_ASSERT_OK(braid_send(&v, 1, BRAID_INT32, 0, comm, nullptr));
      return;
    }
    // Another thread drives, blocked in a receive from rank 1: it is the one
    // that completes the receive from rank 2 and runs its callback.
    std::thread driver([comm] {
      int32_t a = -1;
      EXPECT_EQ(braid_recv(&a, 1, BRAID_INT32, 1, comm, nullptr), BRAID_SUCCESS);
      EXPECT_EQ(a, 1);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    int32_t b = -1;
    braid_request_t req = nullptr;
    BRAID_ASSERT_OK(braid_irecv(&b, 1, BRAID_INT32, 2, comm, nullptr, &req));
    std::atomic<int> returned{0};
    BRAID_ASSERT_OK(braid_request_set_callback(
        req,
        [](void* user, braid_result_t, const char*) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          static_cast<std::atomic<int>*>(user)->store(1);
        },
        &returned));
    BRAID_ASSERT_OK(braid_wait(&req));
    EXPECT_EQ(returned.load(), 1) << "braid_wait returned while the callback still ran";
    EXPECT_EQ(b, 2);
    driver.join();
  });
}

TEST_P(Transports, ManyNonBlockingCollectivesInFlight) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    const int kOps = 12;
    std::vector<std::vector<double>> in(kOps), out(kOps);
    std::vector<braid_request_t> reqs(kOps);
    for (int k = 0; k < kOps; ++k) {
      size_t count = 1 + static_cast<size_t>(k) * 20011;
      in[k].assign(count, static_cast<double>(rank + k));
      out[k].assign(count, 0);
      BRAID_ASSERT_OK(braid_iall_reduce(in[k].data(), out[k].data(), count, BRAID_FLOAT64, BRAID_MAX, comm,
                                        nullptr, &reqs[k]));
    }
    BRAID_ASSERT_OK(braid_wait_all(kOps, reqs.data()));
    for (int k = 0; k < kOps; ++k)
      for (double v : out[k]) ASSERT_EQ(v, 2.0 + k);
  });
}

TEST_P(Transports, SplitByParity) {
  run_ranks(5, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    braid_comm_t half = nullptr;
    // Reverse order inside each half through the key.
    BRAID_ASSERT_OK(braid_comm_split(comm, rank % 2, -rank, &half));
    ASSERT_NE(half, nullptr);
    int hr = -1, hn = -1;
    BRAID_ASSERT_OK(braid_comm_rank(half, &hr));
    BRAID_ASSERT_OK(braid_comm_size(half, &hn));
    const int members = rank % 2 == 0 ? 3 : 2;  // {0,2,4} and {1,3}
    EXPECT_EQ(hn, members);
    int32_t mine = rank, gathered[3] = {-1, -1, -1};
    BRAID_ASSERT_OK(braid_all_gather(&mine, gathered, 1, BRAID_INT32, half, nullptr));
    if (rank % 2 == 0) {
      EXPECT_EQ(hr, (4 - rank) / 2);
      EXPECT_EQ(gathered[0], 4);
      EXPECT_EQ(gathered[1], 2);
      EXPECT_EQ(gathered[2], 0);
    } else {
      EXPECT_EQ(hr, (3 - rank) / 2);
      EXPECT_EQ(gathered[0], 3);
      EXPECT_EQ(gathered[1], 1);
    }
    // The parent still works while the child exists.
    int32_t total = 0;
    BRAID_ASSERT_OK(braid_all_reduce(&mine, &total, 1, BRAID_INT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(total, 10);
    BRAID_ASSERT_OK(braid_comm_destroy(half));
    braid_comm_t none = reinterpret_cast<braid_comm_t>(1);
    BRAID_ASSERT_OK(braid_comm_split(comm, rank == 0 ? 0 : BRAID_SPLIT_NOCOLOR, 0, &none));
    if (rank == 0) {
      ASSERT_NE(none, nullptr);
      BRAID_ASSERT_OK(braid_barrier(none, nullptr));
      BRAID_ASSERT_OK(braid_comm_destroy(none));
    } else {
      EXPECT_EQ(none, nullptr);
    }
    // A negative color on one rank fails the split on every rank at once
    // (its peers waited for it until the deadline), and the parent works on.
    const auto start = std::chrono::steady_clock::now();
    braid_comm_t bad = nullptr;
    EXPECT_EQ(braid_comm_split(comm, rank == 2 ? -5 : 0, 0, &bad), BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad, nullptr);
    EXPECT_NE(std::string(braid_get_last_error())
                  .find(rank == 2 ? "color=-5 is negative" : "rank 2 passed a negative color"),
              std::string::npos)
        << braid_get_last_error();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    BRAID_ASSERT_OK(braid_all_reduce(&mine, &total, 1, BRAID_INT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(total, 10);
    // So does a rank that cannot open the new communicator's listening
    // socket: here rank 1 has no file descriptor left.
    std::vector<int> held;
    rlimit limit{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
    if (rank == 1) {
      int highest = 0;
      for (int fd = 0; fd < 4096; ++fd)
        if (fcntl(fd, F_GETFD) != -1) highest = fd;
      rlimit low = limit;
      low.rlim_cur = static_cast<rlim_t>(highest) + 4;
      ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
      for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) held.push_back(fd);
    }
    const auto again = std::chrono::steady_clock::now();
    EXPECT_NE(braid_comm_split(comm, 0, 0, &bad), BRAID_SUCCESS);
    EXPECT_EQ(bad, nullptr);
    const std::string why = braid_get_last_error();
    EXPECT_NE(why.find(rank == 1 ? "Too many open files" : "rank 1 could not open the new communicator's"),
              std::string::npos)
        << why;
    EXPECT_LT(std::chrono::steady_clock::now() - again, std::chrono::seconds(10));
    for (int fd : held) close(fd);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
    BRAID_ASSERT_OK(braid_all_reduce(&mine, &total, 1, BRAID_INT32, BRAID_SUM, comm, nullptr));
    EXPECT_EQ(total, 10);
  });
}

TEST_P(Transports, CommunicatorsUsedFromTheirOwnThreads) {
  run_ranks(3, transport_env(GetParam()), [](braid_comm_t comm, int rank, int) {
    braid_comm_t comms[2];
    BRAID_ASSERT_OK(braid_comm_split(comm, 0, rank, &comms[0]));
    BRAID_ASSERT_OK(braid_comm_split(comm, 0, -rank, &comms[1]));
    std::vector<int> failures(2, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        for (int it = 0; it < 50; ++it) {
          std::vector<int32_t> in(1000 + it * 37, rank + t), out(in.size(), 0);
          if (braid_all_reduce(in.data(), out.data(), in.size(), BRAID_INT32, BRAID_SUM, comms[t], nullptr) !=
              BRAID_SUCCESS)
            ++failures[t];
          for (int32_t v : out)
            if (v != 3 + 3 * t) ++failures[t];
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failures[0], 0);
    EXPECT_EQ(failures[1], 0);
    BRAID_EXPECT_OK(braid_comm_destroy(comms[0]));
    BRAID_EXPECT_OK(braid_comm_destroy(comms[1]));
  });
}

INSTANTIATE_TEST_SUITE_P(, Transports, ::testing::Values("shm", "tcp"));

uint16_t free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

TEST(InitEnv, TorchrunEnvironment) {
  const std::string port = std::to_string(free_port());
  auto result = launch(
      3,
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}, {"WORLD_SIZE", "3"}, {"BRAID_ROOT_PORT", port}},
      [](braid_comm_t, int rank, int) {
        braid_comm_t comm = nullptr;
        BRAID_ASSERT_OK(braid_comm_init_env(&comm));
        int r = -1;
        BRAID_ASSERT_OK(braid_comm_rank(comm, &r));
        EXPECT_EQ(r, rank);
        float x = 1, sum = 0;
        BRAID_ASSERT_OK(braid_all_reduce(&x, &sum, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
        EXPECT_EQ(sum, 3.0f);
        BRAID_ASSERT_OK(braid_comm_destroy(comm));
      },
      60, /*make_comm=*/false, [](int rank) { setenv("RANK", std::to_string(rank).c_str(), 1); });
  ASSERT_TRUE(result.ok()) << result.describe();
}

// A WORLD_SIZE that differs between ranks reaches the rendezvous root,
// which says so (it is not a stranger with another job's token).
TEST(InitEnv, AWorldSizeThatDiffersIsNamed) {
  const std::string port = std::to_string(free_port());
  auto* named = static_cast<std::atomic<int>*>(
      mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(named), MAP_FAILED);
  new (named) std::atomic<int>(0);
  const auto start = std::chrono::steady_clock::now();
  auto result = launch(
      2,
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", port},
       {"BRAID_ROOT_PORT", port},
       {"BRAID_TIMEOUT", "5"},
       {"BRAID_DEBUG", "NONE"}},
      [named](braid_comm_t, int, int) {
        braid_comm_t comm = nullptr;
        EXPECT_NE(braid_comm_init_env(&comm), BRAID_SUCCESS);
        const std::string msg = braid_get_last_error();
        // The one whose hello came second is refused by name; the other
        // learns that a rank is missing, and why (or times out itself).
        if (msg.find("says the job has") != std::string::npos &&
            msg.find("Refused meanwhile") == std::string::npos)
          named->fetch_add(1);
      },
      60, /*make_comm=*/false,
      [](int rank) {
        setenv("RANK", std::to_string(rank).c_str(), 1);
        setenv("WORLD_SIZE", rank == 0 ? "2" : "3", 1);
      });
  EXPECT_TRUE(result.ok()) << result.describe();
  EXPECT_EQ(named->load(), 1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  munmap(named, sizeof(std::atomic<int>));
}

// A rank that never starts: those that joined hear from the root which one
// is missing, not only that it hung up.
TEST(InitEnv, RanksThatJoinedAreToldWhichRankIsMissing) {
  const auto start = std::chrono::steady_clock::now();
  launcher::LaunchOptions o;
  o.nranks = 3;
  o.make_comm = false;
  o.env = {{"BRAID_DEBUG", "NONE"}};
  // Rank 0 (which runs the root) gives up after 3 s; rank 1 would wait 30 s
  // on its own.
  o.per_rank_setup = [](int rank) { setenv("BRAID_TIMEOUT", rank == 0 ? "3" : "30", 1); };
  auto result = launcher::fork_ranks(o, [](braid_comm_t, int rank, int, const braid_unique_id_t& id) {
    if (rank == 2) return 0;
    braid_comm_t comm = nullptr;
    if (braid_comm_init_rank(&comm, 3, id, rank) == BRAID_SUCCESS) return 1;
    const std::string msg = braid_get_last_error();
    if (rank == 1 && msg.find("rank 2 of 3 did not join the rendezvous") == std::string::npos) {
      std::fprintf(stderr, "rank 1 got: %s\n", msg.c_str());
      return 2;
    }
    return 0;
  });
  EXPECT_TRUE(result.ok()) << result.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// Containers of one pod share /dev/shm and the hostname but not their pid
// namespace, where shm's liveness checks and peer reads cannot see each
// other's pids: such ranks count as different hosts and talk over tcp.
TEST(InitEnv, RanksInAnotherPidNamespaceUseTcp) {
  const pid_t probe = fork();
  if (probe == 0) _exit(unshare(CLONE_NEWPID) == 0 ? 0 : 1);
  int probe_status = 0;
  waitpid(probe, &probe_status, 0);
  if (!WIFEXITED(probe_status) || WEXITSTATUS(probe_status) != 0)
    GTEST_SKIP() << "this process may not make a pid namespace (needs CAP_SYS_ADMIN)";
  const std::string port = std::to_string(free_port());
  auto result = launch(
      2,
      {{"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", port},
       {"WORLD_SIZE", "2"},
       {"BRAID_ROOT_PORT", port},
       {"BRAID_TIMEOUT", "20"}},
      [](braid_comm_t, int rank, int) {
        auto work = [rank] {
          braid_comm_t comm = nullptr;
          BRAID_ASSERT_OK(braid_comm_init_env(&comm));
          std::vector<float> x(300000, 1.0f + rank);
          BRAID_ASSERT_OK(
              braid_all_reduce(x.data(), x.data(), x.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
          for (float v : x) ASSERT_EQ(v, 3.0f);
          uint64_t shm = 0, tcp = 0;
          BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "shm", &shm));
          BRAID_ASSERT_OK(braid_comm_transport_bytes(comm, "tcp", &tcp));
          EXPECT_EQ(shm, 0u);
          EXPECT_GT(tcp, 0u);
          BRAID_ASSERT_OK(braid_comm_destroy(comm));
        };
        if (rank == 0) {
          work();
          return;
        }
        ASSERT_EQ(unshare(CLONE_NEWPID), 0);
        const pid_t child = fork();  // the first child of the new namespace: its pid 1
        if (child == 0) {
          work();
          _exit(::testing::Test::HasFailure() ? 1 : 0);
        }
        int status = 0;
        ASSERT_EQ(waitpid(child, &status, 0), child);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
      },
      60, /*make_comm=*/false, [](int rank) { setenv("RANK", std::to_string(rank).c_str(), 1); });
  ASSERT_TRUE(result.ok()) << result.describe();
}

TEST(SimulatedHosts, TwoHostsMixShmAndTcp) {
  // Ranks 0,1 on "host-a" and 2,3 on "host-b": shm inside a host, tcp across.
  auto result = launch(
      4, {},
      [](braid_comm_t comm, int rank, int nranks) {
        for (size_t count : {size_t{3}, size_t{200003}}) {
          std::vector<int32_t> in(count, rank + 1), out(count, 0);
          BRAID_ASSERT_OK(
              braid_all_reduce(in.data(), out.data(), count, BRAID_INT32, BRAID_SUM, comm, nullptr));
          for (int32_t v : out) ASSERT_EQ(v, nranks * (nranks + 1) / 2);
        }
        std::vector<int32_t> all(8, -1);
        int32_t pair[2] = {rank, -rank};
        BRAID_ASSERT_OK(braid_all_gather(pair, all.data(), 2, BRAID_INT32, comm, nullptr));
        for (int r = 0; r < nranks; ++r) {
          EXPECT_EQ(all[2 * r], r);
          EXPECT_EQ(all[2 * r + 1], -r);
        }
      },
      120, true, [](int rank) { setenv("BRAID_HOST_ID", rank < 2 ? "host-a" : "host-b", 1); });
  ASSERT_TRUE(result.ok()) << result.describe();
}

TEST(SimulatedHosts, ForcedShmAcrossHostsIsRefused) {
  auto result = launch(
      2, {{"BRAID_TRANSPORT", "shm"}}, [](braid_comm_t, int, int) {}, 60, true,
      [](int rank) { setenv("BRAID_HOST_ID", rank == 0 ? "host-a" : "host-b", 1); });
  // Both ranks fail init (exit 90) with a message naming the variable.
  ASSERT_EQ(result.ranks.size(), 2u);
  for (auto& r : result.ranks) EXPECT_EQ(r.exit_code, 90);
}

}  // namespace
}  // namespace braid::test
