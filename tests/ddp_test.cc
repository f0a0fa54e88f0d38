// The DDP layer on forked ranks: training on shards equals training on the
// whole batch in one process, buckets start in order as gradients arrive,
// no_sync accumulates, and a missing gradient or a mismatched model is named.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <braid/ddp.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "examples/mlp_model.h"
#include "tests/rank_test.h"

namespace {

using braid::ddp::Reducer;
using braid::examples::Dataset;
using braid::examples::Mlp;

constexpr int kIn = 8, kHidden = 16, kOut = 4, kBatch = 24, kSteps = 20;
constexpr float kLr = 0.05f;

// Buckets small enough that the 4 parameters land in 4 buckets:
// b2 (16 B) alone in the first, then W2 (256 B), b1 (64 B), W1 (512 B).
braid::ddp::Options small_buckets() {
  braid::ddp::Options o;
  o.first_bucket_bytes = 16;
  o.bucket_bytes = 300;
  return o;
}

std::vector<braid::ddp::Parameter> parameters_of(Mlp* m, bool grads_in_buckets) {
  std::vector<braid::ddp::Parameter> ps;
  for (int k = 0; k < Mlp::kParams; ++k) {
    ps.push_back(
        {m->names[k], m->p[k].data(), grads_in_buckets ? nullptr : m->grad[k], m->count(k), BRAID_FLOAT32});
  }
  return ps;
}

// Points the model's gradients at their bucket slots when they live there.
void adopt_bucket_grads(Mlp* m, const Reducer& ddp) {
  for (int k = 0; k < Mlp::kParams; ++k) m->grad[k] = static_cast<float*>(ddp.grad(k));
}

double expect_close(const Mlp& got, const Mlp& want, double rel, const std::string& what) {
  double overall = 0;
  for (int k = 0; k < Mlp::kParams; ++k) {
    double worst = 0;
    for (size_t e = 0; e < got.count(k); ++e) {
      const double scale = std::max(std::fabs(static_cast<double>(want.p[k][e])), 1e-3);
      worst = std::max(worst, std::fabs(static_cast<double>(got.p[k][e]) - want.p[k][e]) / scale);
    }
    EXPECT_LE(worst, rel) << what << ": " << want.names[k] << " differs by " << worst << " relative";
    overall = std::max(overall, worst);
  }
  return overall;
}

// One process, the whole batch: the reference every rank compares against.
Mlp train_alone(const Dataset& data, int steps, int micro_batches) {
  Mlp m(kIn, kHidden, kOut, 7);
  const int rows = data.rows / micro_batches;
  for (int s = 0; s < steps; ++s) {
    m.zero_grad();
    for (int mb = 0; mb < micro_batches; ++mb)
      m.backward(data.x_row(mb * rows), data.t_row(mb * rows), rows, {});
    m.sgd(kLr);
  }
  return m;
}

uint64_t window_bytes(braid_comm_t comm) {
  uint64_t b = 0;
  EXPECT_EQ(braid_comm_transport_bytes(comm, "shm_window", &b), BRAID_SUCCESS) << braid_get_last_error();
  return b;
}

// expect_windows: the buckets are registered and their all_reduces moved
// data between the ranks' buckets (run with a low BRAID_WINDOW_MIN_BYTES:
// these buckets are small).
void train_on_shards(int nranks, const braid::ddp::Options& options, bool grads_in_buckets,
                     const braid::test::Env& env = {}, bool expect_windows = false) {
  braid::test::run_ranks(nranks, env, [&](braid_comm_t comm, int rank, int n) {
    const Dataset data(kBatch, kIn, kOut, 1234);
    // Ranks other than 0 start from other values: the Reducer must replace them with rank 0's.
    Mlp m(kIn, kHidden, kOut, rank == 0 ? 7 : 100 + rank);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, grads_in_buckets), {}, options, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    if (grads_in_buckets) adopt_bucket_grads(&m, *ddp);
    const int rows = kBatch / n;
    for (int s = 0; s < kSteps; ++s) {
      m.zero_grad();
      m.backward(data.x_row(rank * rows), data.t_row(rank * rows), rows, [&](int k) {
        auto rr = ddp->mark_ready(k);
        EXPECT_TRUE(rr.ok()) << rr.message;
      });
      r = ddp->finish();
      ASSERT_TRUE(r.ok()) << r.message;
      m.sgd(kLr);
    }
    EXPECT_EQ(ddp->buckets_registered(), options.register_buckets);
    if (options.register_buckets) {
      EXPECT_NE(ddp->bucket_comm(), comm) << "registered buckets run on the Reducer's own communicator";
    } else {
      EXPECT_EQ(ddp->bucket_comm(), comm);
    }
    if (expect_windows) {
      EXPECT_GT(window_bytes(ddp->bucket_comm()), 0u)
          << "the buckets' all_reduces went through the transport";
    } else {
      EXPECT_EQ(window_bytes(ddp->bucket_comm()), 0u);
    }
    const double worst = expect_close(m, train_alone(data, kSteps, 1), 1e-5, "rank " + std::to_string(rank));
    if (rank == 0) {
      std::printf("%d ranks, %d steps: largest relative difference from one process %.2e\n", n, kSteps,
                  worst);
    }
    // Every replica holds exactly the same parameters.
    for (int k = 0; k < Mlp::kParams; ++k) {
      std::vector<float> all(m.count(k) * n);
      BRAID_ASSERT_OK(braid_all_gather(m.p[k].data(), all.data(), m.count(k), BRAID_FLOAT32, comm, nullptr));
      for (int q = 0; q < n; ++q) {
        EXPECT_EQ(std::memcmp(&all[q * m.count(k)], m.p[k].data(), m.count(k) * sizeof(float)), 0)
            << m.names[k] << " differs between rank " << rank << " and rank " << q;
      }
    }
  });
}

TEST(Ddp, TwoRanksTrainLikeOneProcess) {
  train_on_shards(2, small_buckets(), false);
}
TEST(Ddp, ThreeRanksTrainLikeOneProcessWithGradientsInBuckets) {
  train_on_shards(3, small_buckets(), true);
}
TEST(Ddp, FourRanksTrainLikeOneProcessWithDefaultBuckets) {
  train_on_shards(4, braid::ddp::Options{}, false);
}

TEST(Ddp, RegisteredBucketsTrainLikeOneProcessThroughTheWindows) {
  train_on_shards(3, small_buckets(), true, {{"BRAID_WINDOW_MIN_BYTES", "1"}}, true);
}
// Over tcp the ranks cannot map each other's memory: the registration is
// kept and changes nothing.
TEST(Ddp, RegisteredBucketsOverTcpTrainLikeOneProcessWithoutWindows) {
  train_on_shards(2, small_buckets(), true, {{"BRAID_WINDOW_MIN_BYTES", "1"}, {"BRAID_TRANSPORT", "tcp"}});
}
TEST(Ddp, PlainBucketsTrainLikeOneProcessOnTheGivenCommunicator) {
  braid::ddp::Options o = small_buckets();
  o.register_buckets = false;
  train_on_shards(2, o, true, {{"BRAID_WINDOW_MIN_BYTES", "1"}});
}

// The Reducer's communicator ends on each rank alone: a rank that destroys
// its Reducer while a peer still uses the communicator given to create
// (whose collectives must not meet a deregistration) carries on with it.
TEST(Ddp, AReducerDestroyedOnOneRankLeavesTheCommunicatorFree) {
  braid::test::run_ranks(2, {{"BRAID_WINDOW_MIN_BYTES", "1"}}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, true), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    ASSERT_TRUE(ddp->buckets_registered());
    for (int k = 0; k < Mlp::kParams; ++k) ASSERT_TRUE(ddp->mark_ready(k).ok());
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    // Rank 0 destroys first, then all-reduces; rank 1 all-reduces first.
    braid_comm_t own = ddp->bucket_comm();
    ASSERT_NE(own, comm);
    if (rank == 0) ddp.reset();
    std::vector<float> v(4096, static_cast<float>(rank + 1));
    BRAID_ASSERT_OK(braid_all_reduce(v.data(), v.data(), v.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr));
    for (float x : v) ASSERT_EQ(x, 3.0f);
    ddp.reset();
    int ignored = 0;
    EXPECT_EQ(braid_comm_rank(own, &ignored), BRAID_ERR_INVALID_ARGUMENT)
        << "the Reducer's communicator outlived it";
  });
}

// The Reducer's communicator is its own: a watchdog ends a step that hangs
// on a peer by aborting bucket_comm(), and the Reducer still goes cleanly.
TEST(Ddp, AbortingTheBucketCommunicatorEndsAHungStep) {
  braid::test::run_ranks(2, {{"BRAID_TIMEOUT", "60"}}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, true), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    if (rank == 0) {
      // Rank 1 never begins the step.
      for (int k = 0; k < Mlp::kParams; ++k) ASSERT_TRUE(ddp->mark_ready(k).ok());
      braid_comm_t own = ddp->bucket_comm();
      std::thread watchdog([own] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        EXPECT_EQ(braid_comm_abort(own), BRAID_SUCCESS) << braid_get_last_error();
      });
      r = ddp->finish();
      watchdog.join();
      EXPECT_EQ(r.code, BRAID_ERR_ABORTED) << r.message;
    }
    BRAID_ASSERT_OK(braid_barrier(comm, nullptr));
    ddp.reset();
  });
}

// A rank that cannot allocate its buckets fails create on every rank at
// once: its peers would otherwise wait in the parameters' broadcast until
// their deadline.
TEST(Ddp, ARankWithoutMemoryForItsBucketsFailsCreateEverywhere) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "limits the address space, which the sanitizers' shadow memory fills";
#else
  braid::test::run_ranks(2, {{"BRAID_TIMEOUT", "30"}}, [&](braid_comm_t comm, int rank, int) {
    constexpr size_t kCount = size_t{64} << 20;                             // 256 MiB of float32
    float* data = static_cast<float*>(std::calloc(kCount, sizeof(float)));  // untouched pages
    ASSERT_NE(data, nullptr);
    rlimit limit{};
    ASSERT_EQ(getrlimit(RLIMIT_AS, &limit), 0);
    if (rank == 1) {
      // Room for what create needs besides the buckets, not for them.
      size_t vm_kib = 0;
      std::FILE* f = std::fopen("/proc/self/status", "r");
      ASSERT_NE(f, nullptr);
      char line[256];
      while (std::fgets(line, sizeof line, f) != nullptr)
        if (std::sscanf(line, "VmSize: %zu kB", &vm_kib) == 1) break;
      std::fclose(f);
      ASSERT_GT(vm_kib, 0u);
      rlimit low = limit;
      low.rlim_cur = static_cast<rlim_t>(vm_kib * 1024 + (size_t{128} << 20));
      ASSERT_EQ(setrlimit(RLIMIT_AS, &low), 0);
    }
    const auto start = std::chrono::steady_clock::now();
    std::unique_ptr<Reducer> ddp;
    auto r =
        Reducer::create(comm, {{"w", data, nullptr, kCount, BRAID_FLOAT32}}, {}, braid::ddp::Options{}, &ddp);
    ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
    EXPECT_EQ(r.code, BRAID_ERR_SYSTEM) << r.message;
    EXPECT_NE(
        r.message.find(rank == 1 ? "cannot allocate" : "rank 1 could not allocate its gradient buckets"),
        std::string::npos)
        << r.message;
    EXPECT_EQ(ddp, nullptr);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
    std::free(data);
    BRAID_ASSERT_OK(braid_barrier(comm, nullptr));
  });
#endif
}

TEST(Ddp, BucketsStartInOrderAsGradientsArrive) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    ASSERT_EQ(ddp->buckets().size(), 4u);
    for (size_t b = 0; b < 4; ++b) {
      ASSERT_EQ(ddp->buckets()[b].parameters, std::vector<size_t>{3 - b}) << "bucket " << b;
    }
    EXPECT_EQ(ddp->buckets()[0].bytes, 16u);
    EXPECT_EQ(ddp->buckets()[3].bytes, 512u);
    // Each bucket starts the moment its gradient is ready...
    ASSERT_TRUE(ddp->mark_ready(3).ok());
    EXPECT_EQ(ddp->buckets_started(), 1u);
    ASSERT_TRUE(ddp->mark_ready(2).ok());
    EXPECT_EQ(ddp->buckets_started(), 2u);
    // ...but never ahead of an earlier bucket: W1's bucket waits for b1's.
    ASSERT_TRUE(ddp->mark_ready(0).ok());
    EXPECT_EQ(ddp->buckets_started(), 2u);
    ASSERT_TRUE(ddp->mark_ready(1).ok());
    // The last bucket waits for finish(), so that a rank dropping the step
    // after its backward pass still has a bucket to say so.
    EXPECT_EQ(ddp->buckets_started(), 3u);
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(ddp->buckets_started(), 0u);
    EXPECT_EQ(ddp->last_start_order(), (std::vector<size_t>{0, 1, 2, 3}));
    // The default first bucket (1 MiB) holds the whole small model.
    std::unique_ptr<Reducer> one;
    r = Reducer::create(comm, parameters_of(&m, false), {}, braid::ddp::Options{}, &one);
    ASSERT_TRUE(r.ok()) << r.message;
    ASSERT_EQ(one->buckets().size(), 1u);
    EXPECT_EQ(one->buckets()[0].parameters, (std::vector<size_t>{3, 2, 1, 0}));
  });
}

TEST(Ddp, NoSyncAccumulatesThenAverages) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int n) {
    const Dataset data(kBatch, kIn, kOut, 99);
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    // Two micro-batches per step; rank r takes its share of each.
    const int micro_rows = kBatch / 2, rows = micro_rows / n;
    auto mark = [&](int k) { EXPECT_TRUE(ddp->mark_ready(k).ok()); };
    for (int s = 0; s < 5; ++s) {
      m.zero_grad();
      {
        auto scope = ddp->no_sync();
        m.backward(data.x_row(rank * rows), data.t_row(rank * rows), rows, mark);
        EXPECT_EQ(ddp->buckets_started(), 0u) << "no_sync must not communicate";
        ASSERT_TRUE(ddp->finish().ok());
      }
      m.backward(data.x_row(micro_rows + rank * rows), data.t_row(micro_rows + rank * rows), rows, mark);
      r = ddp->finish();
      ASSERT_TRUE(r.ok()) << r.message;
      m.sgd(kLr);
    }
    expect_close(m, train_alone(data, 5, 2), 1e-5, "rank " + std::to_string(rank));
  });
}

TEST(Ddp, MissingGradientIsNamed) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    for (int k : {3, 2, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());  // fc1.bias never
    r = ddp->finish();
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_USAGE);
    EXPECT_NE(r.message.find("parameter 'fc1.bias' (index 1) never became ready"), std::string::npos)
        << r.message;
    EXPECT_NE(r.message.find("allow_unused_parameters"), std::string::npos) << r.message;
    // The next step is clean again.
    for (int k : {3, 2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    r = ddp->finish();
    EXPECT_TRUE(r.ok()) << r.message;
  });
}

// A Reducer over m's parameters (gradients in m.grad) that allows unused ones.
std::unique_ptr<Reducer> allowing_unused(braid_comm_t comm, Mlp* m) {
  auto options = small_buckets();
  options.allow_unused_parameters = true;
  std::unique_ptr<Reducer> ddp;
  auto r = Reducer::create(comm, parameters_of(m, false), {}, options, &ddp);
  EXPECT_TRUE(r.ok()) << r.message;
  return ddp;
}

void fill_grads(Mlp* m, float value) {
  for (int k = 0; k < Mlp::kParams; ++k) std::fill(m->grad[k], m->grad[k] + m->count(k), value);
}

// One rank drops a step after two of its four buckets started (a failed
// finish(), abandon_step, or its Reducer destroyed): the peers' finish()
// fails and says so, and the next step averages that step's gradients only.
// Before, the peers' waiting buckets paired with the dropping rank's next
// step: both finish() calls succeeded with gradients of two steps mixed.
// "... after backward": every gradient was marked, so every bucket but the
// last had started (a NaN loss found after backward, then abandon_step): the
// drop was local before the last bucket waited for the step's end, and the
// peers' finish() succeeded while rank 1 skipped the step.
TEST(Ddp, ARankThatDropsAStepFailsItOnEveryRank) {
  for (const std::string how :
       {"finish", "abandon", "destroy", "abandon after backward", "destroy after backward"}) {
    SCOPED_TRACE(how);
    braid::test::run_ranks(3, {}, [&](braid_comm_t comm, int rank, int) {
      Mlp m(kIn, kHidden, kOut, 7);
      std::unique_ptr<Reducer> ddp;
      auto r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
      ASSERT_TRUE(r.ok()) << r.message;
      fill_grads(&m, 1.0f + rank);
      if (rank == 1) {
        const bool whole = how.find("after backward") != std::string::npos;
        for (int k : {3, 2, 1, 0}) {
          if (!whole && k < 2) break;
          ASSERT_TRUE(ddp->mark_ready(k).ok());
        }
        if (how == "finish") {
          r = ddp->finish();  // fc1 never ready
          EXPECT_NE(r.message.find("never became ready"), std::string::npos) << r.message;
        } else if (how.rfind("abandon", 0) == 0) {
          r = ddp->abandon_step();
          EXPECT_TRUE(r.ok()) << r.message;
        } else {
          ddp.reset();
        }
      } else {
        for (int k : {3, 2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
        r = ddp->finish();
        EXPECT_EQ(r.code, BRAID_ERR_INVALID_USAGE);
        EXPECT_NE(r.message.find("1 rank(s) dropped this step"), std::string::npos) << r.message;
      }
      if (how.rfind("destroy", 0) == 0) {  // every rank makes a new one (create is collective)
        r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
        ASSERT_TRUE(r.ok()) << r.message;
      }
      // The next step: 10, 20, 30 average to 20 everywhere.
      fill_grads(&m, 10.0f * (rank + 1));
      for (int k : {3, 2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
      r = ddp->finish();
      ASSERT_TRUE(r.ok()) << r.message;
      for (int k = 0; k < Mlp::kParams; ++k)
        for (size_t e = 0; e < m.count(k); ++e) ASSERT_EQ(m.grad[k][e], 20.0f) << m.names[k] << " " << e;
    });
  }
}

TEST(Ddp, UnusedParameterContributesZero) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    auto ddp = allowing_unused(comm, &m);
    ASSERT_NE(ddp, nullptr);
    // Gradient of every element: rank + 1. Rank 0 leaves fc1.bias unused.
    fill_grads(&m, rank + 1.0f);
    for (int k : {3, 2, 1, 0}) {
      if (rank == 0 && k == 1) continue;
      ASSERT_TRUE(ddp->mark_ready(k).ok());
    }
    auto r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(m.grad[1][0], 1.0f);  // (0 + 2) / 2
    EXPECT_EQ(m.grad[0][0], 1.5f);  // (1 + 2) / 2
    EXPECT_EQ(m.grad[3][3], 1.5f);
    EXPECT_TRUE(ddp->used_in_last_step(1));  // rank 1 used it
    // Unused on every rank: its grad stays as it was (torch leaves it None).
    fill_grads(&m, 7.0f);
    for (int k : {3, 2, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_FALSE(ddp->used_in_last_step(1));
    EXPECT_TRUE(ddp->used_in_last_step(0));
    for (size_t e = 0; e < m.count(1); ++e) ASSERT_EQ(m.grad[1][e], 7.0f) << e;
  });
}

// A gradient that lives in its bucket slot, unused on every rank, keeps
// what it held, as a Parameter's own grad does (finish() zeroed the slot
// for the all_reduce and left the zeros).
TEST(Ddp, UnusedGradientInItsBucketKeepsItsValue) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    auto options = small_buckets();
    options.allow_unused_parameters = true;
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, true), {}, options, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    adopt_bucket_grads(&m, *ddp);
    fill_grads(&m, rank + 1.0f);
    // fc1.bias (1) unused everywhere; fc1.weight (0) unused on rank 0 only.
    for (int k : {3, 2, 0}) {
      if (rank == 0 && k == 0) continue;
      ASSERT_TRUE(ddp->mark_ready(k).ok());
    }
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_FALSE(ddp->used_in_last_step(1));
    for (size_t e = 0; e < m.count(1); ++e) ASSERT_EQ(m.grad[1][e], rank + 1.0f) << e;
    EXPECT_TRUE(ddp->used_in_last_step(0));
    for (size_t e = 0; e < m.count(0); ++e) ASSERT_EQ(m.grad[0][e], 1.0f) << e;  // (0 + 2) / 2
    EXPECT_EQ(m.grad[3][0], 1.5f);
  });
}

// Bucket order is the order buckets fill, whatever order their dtypes were
// opened in: norms (float64) registered after each weight (float32) share one
// bucket, which fills only when the first norm's gradient comes. Before, that
// bucket was opened first, so it was bucket 0, and no weight's bucket could
// start until the end of the backward pass.
TEST(Ddp, BucketsOfSeveralDtypesStartAsTheyFill) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    constexpr int kLayers = 3;
    std::vector<std::vector<float>> w(kLayers, std::vector<float>(16)), wg(kLayers, std::vector<float>(16));
    std::vector<std::vector<double>> n(kLayers, std::vector<double>(2)), ng(kLayers, std::vector<double>(2));
    std::vector<braid::ddp::Parameter> ps;  // w0, n0, w1, n1, w2, n2
    for (int l = 0; l < kLayers; ++l) {
      ps.push_back({"w" + std::to_string(l), w[l].data(), wg[l].data(), 16, BRAID_FLOAT32});
      ps.push_back({"n" + std::to_string(l), n[l].data(), ng[l].data(), 2, BRAID_FLOAT64});
    }
    braid::ddp::Options options;
    options.bucket_bytes = options.first_bucket_bytes = 64;  // one weight, or every norm
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, ps, {}, options, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    ASSERT_EQ(ddp->buckets().size(), 4u);
    EXPECT_EQ(ddp->buckets()[0].parameters, std::vector<size_t>{4});          // w2
    EXPECT_EQ(ddp->buckets()[1].parameters, std::vector<size_t>{2});          // w1
    EXPECT_EQ(ddp->buckets()[2].parameters, (std::vector<size_t>{5, 3, 1}));  // n2, n1, n0
    EXPECT_EQ(ddp->buckets()[2].dtype, BRAID_FLOAT64);
    EXPECT_EQ(ddp->buckets()[3].parameters, std::vector<size_t>{0});  // w0
    for (int l = 0; l < kLayers; ++l) {
      std::fill(wg[l].begin(), wg[l].end(), (rank + 1.0f) * (l + 1));
      std::fill(ng[l].begin(), ng[l].end(), (rank + 1.0) * -(l + 1));
    }
    // Backward order: n2 w2 n1 w1 n0 w0.
    const size_t started_after[] = {0, 1, 1, 2, 3, 3};
    const size_t order[] = {5, 4, 3, 2, 1, 0};
    for (int k = 0; k < 6; ++k) {
      ASSERT_TRUE(ddp->mark_ready(order[k]).ok());
      EXPECT_EQ(ddp->buckets_started(), started_after[k]) << "after " << ps[order[k]].name;
    }
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    for (int l = 0; l < kLayers; ++l) {
      for (float g : wg[l]) ASSERT_EQ(g, 1.5f * (l + 1)) << "w" << l;
      for (double g : ng[l]) ASSERT_EQ(g, -1.5 * (l + 1)) << "n" << l;
    }
  });
}

TEST(Ddp, UnusedAfterNoSyncKeepsWhatItAccumulated) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    auto ddp = allowing_unused(comm, &m);
    ASSERT_NE(ddp, nullptr);
    // A no_sync micro-batch uses every parameter: gradient rank + 1.
    fill_grads(&m, rank + 1.0f);
    {
      auto scope = ddp->no_sync();
      for (int k : {3, 2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
      ASSERT_TRUE(ddp->finish().ok());
    }
    // The synchronised one adds 10 to all but fc1.bias, unused on every rank.
    for (int k : {3, 2, 0})
      for (size_t e = 0; e < m.count(k); ++e) m.grad[k][e] += 10.0f;
    for (int k : {3, 2, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    auto r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(m.grad[1][0], 1.5f);           // (1 + 2) / 2: what it accumulated, not zero
    EXPECT_EQ(m.grad[0][0], 11.5f);          // (11 + 12) / 2
    EXPECT_TRUE(ddp->used_in_last_step(1));  // accumulated counts as used
    // The next window starts afresh: unused again on every rank, it keeps
    // what its grad holds.
    fill_grads(&m, rank + 1.0f);
    for (int k : {3, 2, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    ASSERT_TRUE(ddp->finish().ok());
    EXPECT_FALSE(ddp->used_in_last_step(1));
    EXPECT_EQ(m.grad[1][0], rank + 1.0f);
  });
}

TEST(Ddp, AStepWhoseGradientsCameInsideNoSyncStaysLocal) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false), {}, small_buckets(), &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    fill_grads(&m, rank + 1.0f);
    {
      auto scope = ddp->no_sync();
      for (int k : {3, 2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    }
    EXPECT_FALSE(ddp->step_synchronised());
    // The scope ended before finish(): the step stays local, its gradients untouched.
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(ddp->buckets_started(), 0u);
    EXPECT_EQ(m.grad[0][0], rank + 1.0f);
    EXPECT_EQ(m.grad[3][0], rank + 1.0f);
    // A scope opened after the step's first gradient does not stop it.
    EXPECT_TRUE(ddp->step_synchronised());
    ASSERT_TRUE(ddp->mark_ready(3).ok());
    {
      auto scope = ddp->no_sync();
      for (int k : {2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
      r = ddp->finish();
    }
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(m.grad[0][0], 1.5f);
    EXPECT_EQ(m.grad[3][0], 1.5f);
  });
}

TEST(Ddp, ParametersAndBuffersComeFromRankZero) {
  braid::test::run_ranks(3, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, kHidden, kOut, 50 + rank);
    const Mlp zero(kIn, kHidden, kOut, 50);
    std::vector<double> running(5, rank * 10.0);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false),
                             {{"bn.running_mean", running.data(), running.size(), BRAID_FLOAT64}},
                             braid::ddp::Options{}, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    for (int k = 0; k < Mlp::kParams; ++k) EXPECT_EQ(m.p[k], zero.p[k]) << m.names[k];
    EXPECT_EQ(running, std::vector<double>(5, 0.0));
    running.assign(5, rank + 0.5);
    r = ddp->sync_buffers();
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(running, std::vector<double>(5, 0.5));
  });
}

// Every rank names the first tensor that differs, with both sides; where
// the numbers of tensors differ, it says so.
TEST(Ddp, DifferentModelsAcrossRanksAreAMismatch) {
  braid::test::run_ranks(3, {}, [&](braid_comm_t comm, int rank, int) {
    Mlp m(kIn, rank == 2 ? kHidden + 1 : kHidden, kOut, 7);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, parameters_of(&m, false), {}, braid::ddp::Options{}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_MISMATCH) << r.message;
    const std::string expected = "parameter 'fc1.weight' (index 0) has " +
                                 std::to_string(kIn * (kHidden + 1)) + " elements float32 on rank 2 and " +
                                 std::to_string(kIn * kHidden) + " elements float32 on rank 0";
    EXPECT_NE(r.message.find(expected), std::string::npos) << r.message;
    EXPECT_EQ(ddp, nullptr);

    auto fewer = parameters_of(&m, false);
    if (rank == 1) fewer.pop_back();
    r = Reducer::create(comm, fewer, {}, braid::ddp::Options{}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_MISMATCH) << r.message;
    EXPECT_NE(r.message.find("rank 1 registered 3 parameters and 0 buffers, rank 0 4 and 0"),
              std::string::npos)
        << r.message;
  });
}

// Shapes, where given, must agree too (torch's DDP compares them): the same
// count in another shape is a mismatch, named on every rank; a shape that
// does not hold count elements is refused.
TEST(Ddp, ShapesMustAgreeWhereGiven) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    std::vector<float> w(8), g(8), stats(6);
    std::unique_ptr<Reducer> ddp;
    std::vector<int64_t> shape = rank == 0 ? std::vector<int64_t>{2, 4} : std::vector<int64_t>{4, 2};
    braid::ddp::Parameter weight{"w", w.data(), g.data(), 8, BRAID_FLOAT32, {2, 4}};
    auto r = Reducer::create(comm, {weight}, {{"stats", stats.data(), 6, BRAID_FLOAT32, {1, 6}}}, {}, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    ddp.reset();
    r = Reducer::create(comm, {{"w", w.data(), g.data(), 8, BRAID_FLOAT32, shape}}, {}, {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_MISMATCH) << r.message;
    EXPECT_NE(r.message.find("parameter 'w' (index 0) has shape [4, 2] float32 on rank 1 and shape [2, 4] "
                             "float32 on rank 0"),
              std::string::npos)
        << r.message;
    r = Reducer::create(comm, {weight}, {{"stats", stats.data(), 6, BRAID_FLOAT32, {rank == 0 ? 1 : 3, 6}}},
                        {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT) << r.message;
    const char* expected = rank == 1 ? "buffer 'stats' (index 0) has shape [3, 6] (18 elements) but count 6"
                                     : "rank 1 refused its arguments";
    EXPECT_NE(r.message.find(expected), std::string::npos) << r.message;
  });
}

// Parameters with no elements (torch allows them) take part like any other;
// Options that differ between ranks are named on every rank at create.
TEST(Ddp, EmptyParametersTrainAndOptionsMustAgree) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    std::vector<float> w(4, 1.0f), g(4, 2.0f * (rank + 1));
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm,
                             {{"empty", nullptr, nullptr, 0, BRAID_FLOAT32},
                              {"w", w.data(), g.data(), 4, BRAID_FLOAT32},
                              {"empty_grad", nullptr, nullptr, 0, BRAID_FLOAT32}},
                             {}, {}, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    for (size_t k : {2, 1, 0}) ASSERT_TRUE(ddp->mark_ready(k).ok());
    r = ddp->finish();
    ASSERT_TRUE(r.ok()) << r.message;
    for (float v : g) EXPECT_EQ(v, 3.0f);
    ddp.reset();
    braid::ddp::Options options;
    if (rank == 1) options.bucket_bytes = 1 << 20;
    r = Reducer::create(comm, {{"w", w.data(), g.data(), 4, BRAID_FLOAT32}}, {}, options, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_MISMATCH) << r.message;
    EXPECT_NE(r.message.find("rank 1's Options (bucket_bytes"), std::string::npos) << r.message;
  });
}

// Arguments one rank refuses fail create on every rank at once: its peers
// waited in the model comparison until their deadline before.
TEST(Ddp, ArgumentsOneRankRefusesFailEveryRank) {
  braid::test::run_ranks(2, {{"BRAID_TIMEOUT", "30"}}, [&](braid_comm_t comm, int rank, int) {
    std::vector<float> w(4), g(4);
    std::unique_ptr<Reducer> ddp;
    const auto start = std::chrono::steady_clock::now();
    auto r = Reducer::create(comm, {{"w", rank == 1 ? nullptr : w.data(), g.data(), 4, BRAID_FLOAT32}}, {},
                             {}, &ddp);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find(rank == 1 ? "has data == nullptr" : "rank 1 refused its arguments"),
              std::string::npos)
        << r.message;
    EXPECT_EQ(ddp, nullptr);
    // The communicator is fine: the next create works.
    r = Reducer::create(comm, {{"w", w.data(), g.data(), 4, BRAID_FLOAT32}}, {}, {}, &ddp);
    EXPECT_TRUE(r.ok()) << r.message;
  });
}

TEST(Ddp, BadArgumentsAreNamed) {
  braid::test::run_ranks(1, {}, [&](braid_comm_t comm, int, int) {
    std::vector<float> w(4), g(4);
    std::vector<int32_t> steps(1);
    std::unique_ptr<Reducer> ddp;
    auto r = Reducer::create(comm, {{"step", steps.data(), nullptr, 1, BRAID_INT32}}, {}, {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(r.message.find("parameter 'step' (index 0) has dtype int32"), std::string::npos) << r.message;
    r = Reducer::create(
        comm, {{"w", w.data(), g.data(), 4, BRAID_FLOAT32}, {"nodata", nullptr, g.data(), 4, BRAID_FLOAT32}},
        {}, {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(r.message.find("parameter 'nodata' (index 1) has data == nullptr"), std::string::npos)
        << r.message;
    r = Reducer::create(nullptr, {{"w", w.data(), g.data(), 4, BRAID_FLOAT32}}, {}, {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT) << r.message;
    r = Reducer::create(comm, {}, {}, {}, &ddp);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(r.message.find("no parameters"), std::string::npos) << r.message;

    r = Reducer::create(comm, {{"w", w.data(), g.data(), 4, BRAID_FLOAT32}}, {}, {}, &ddp);
    ASSERT_TRUE(r.ok()) << r.message;
    r = ddp->mark_ready(1);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_ARGUMENT);
    EXPECT_NE(r.message.find("parameter index 1 is out of range (1 parameters)"), std::string::npos)
        << r.message;
    ASSERT_TRUE(ddp->mark_ready(0).ok());
    r = ddp->mark_ready(0);
    EXPECT_EQ(r.code, BRAID_ERR_INVALID_USAGE);
    EXPECT_NE(r.message.find("parameter 'w' (index 0) was marked ready twice"), std::string::npos)
        << r.message;
    EXPECT_TRUE(ddp->finish().ok());
  });
}

}  // namespace
